"""rlrun.retriever_server: the BM25 index (hand-computed scores) and the server as a real process on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from retriever_process import EXAMPLE_CORPUS, RetrieverProcess, start_retriever, stop_retriever

from rlrun.serving.retriever import Bm25Index

pytestmark = pytest.mark.timeout(120)

TINY_CORPUS = [
    {"id": "0", "contents": '"Paris"\nParis is the capital of France.'},
    {"id": "1", "contents": '"Mount Everest"\nEverest is the highest mountain.'},
]


def request(server: RetrieverProcess, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


def retrieve(server: RetrieverProcess, payload: object) -> tuple[int, dict]:
    return request(server, "POST", "/retrieve", json.dumps(payload).encode())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = start_retriever(tmp_path_factory.mktemp("retriever"),
                          extra_args=["--topk", "3", "--max_queries", "4", "--max_query_chars", "60",
                                      "--max_request_bytes", "2000"])
    try:
        yield srv
    finally:
        stop_retriever(srv.proc)


def test_bm25_scores_by_hand() -> None:
    # Lucene BM25, k1=0.9, b=0.4, English stopwords dropped, lower-cased:
    # doc 0 = [paris, paris, capital, france] (4 tokens), doc 1 = [mount, everest, everest, highest, mountain] (5).
    # avgdl = 4.5. "capital": df=1 of N=2 -> idf = ln(1 + (2 - 1 + 0.5) / (1 + 0.5)) = ln 2;
    # tf=1, dl=4: 1 / (1 + 0.9 * (1 - 0.4 + 0.4 * 4 / 4.5)) = 1 / 1.86.
    # "everest": tf=2, dl=5: 2 / (2 + 0.9 * (1 - 0.4 + 0.4 * 5 / 4.5)) = 2 / 2.94.
    index = Bm25Index(TINY_CORPUS)
    capital, everest, nothing = index.search(["Capital?", "everest", "unknownword the"], topk=5)
    assert [h.document["id"] for h in capital] == ["0"]  # doc 1 has no query term: not a hit (Lucene)
    assert capital[0].score == pytest.approx(math.log(2) / 1.86, rel=1e-5)
    assert [h.document["id"] for h in everest] == ["1"]
    assert everest[0].score == pytest.approx(math.log(2) * 2 / 2.94, rel=1e-5)
    assert nothing == []
    assert index.search([], topk=3) == []


def test_health_counts_documents(server: RetrieverProcess) -> None:
    assert request(server, "GET", "/health") == (200, {"status": "ok", "documents": 30})


@pytest.mark.parametrize("query, doc_id", [
    ("Eiffel Tower", "0"), ("Mount Kilimanjaro", "28"), ("Python (programming language)", "25"),
    ("Pride and Prejudice", "3"), ("2014 FIFA World Cup", "24"),
])
def test_query_from_title_finds_that_document_first(server: RetrieverProcess, query: str, doc_id: str) -> None:
    status, body = retrieve(server, {"queries": [query], "topk": 3, "return_scores": True})
    assert status == 200
    [hits] = body["result"]
    assert hits[0]["document"]["id"] == doc_id
    title = hits[0]["document"]["contents"].split("\n")[0]
    assert title == f'"{query}"'
    scores = [hit["score"] for hit in hits]
    assert scores == sorted(scores, reverse=True) and all(isinstance(s, float) and s > 0 for s in scores)


def test_topk_and_default_and_documents_without_scores(server: RetrieverProcess) -> None:
    broad = "capital largest highest mountain planet river"
    for topk, expected in ((1, 1), (5, 5), (None, 3)):
        payload = {"queries": [broad], "return_scores": True} | ({} if topk is None else {"topk": topk})
        status, body = retrieve(server, payload)
        assert status == 200 and len(body["result"][0]) == expected, (topk, body)
    status, body = retrieve(server, {"queries": [broad], "topk": 2})  # Search-R1: documents only
    assert status == 200
    assert all(set(doc) == {"id", "contents"} for doc in body["result"][0]) and len(body["result"][0]) == 2
    status, body = retrieve(server, {"queries": ["Eiffel"], "topk": 100})  # more than match: only the hits
    assert status == 200 and [d["id"] for d in body["result"][0]] == ["0"]


def test_one_request_is_one_batch_in_the_log(server: RetrieverProcess) -> None:
    before = server.wait_log_lines("POST /retrieve -> 200 batch=3", 0)
    status, body = retrieve(server, {"queries": ["Canberra", "zzzz", "Jupiter planet"], "return_scores": True})
    assert status == 200
    assert [[h["document"]["id"] for h in hits][:1] for hits in body["result"]] == [["7"], [], ["10"]]
    assert server.wait_log_lines("POST /retrieve -> 200 batch=3", before + 1) == before + 1


@pytest.mark.parametrize("payload, status, fragment", [
    ({"queries": ["a"] * 5}, 413, "5 queries in one request is over the limit of 4"),
    ({"queries": ["ok", "x" * 61]}, 400, "query [1] has 61 characters, over the limit of 60"),
    ({"queries": ["x" * 2100]}, 413, "over the limit of 2000 bytes"),
    ({"queries": "one string"}, 400, "'queries' must be a list of strings"),
    ({"query": ["a"]}, 400, "unknown key(s) ['query']"),
    ({"queries": ["a"], "topk": "3"}, 400, "'topk' must be a positive integer"),
    ({"queries": ["a"], "topk": -1}, 400, "'topk' must be a positive integer"),
    ({"queries": ["a"], "topk": 0}, 400, "'topk' must be a positive integer, got 0; omit it or send null"),
    ({"queries": ["a"], "return_scores": "yes"}, 400, "'return_scores' must be true or false"),
    ([1], 400, "must be a JSON object"),
])
def test_limits_and_bad_requests(server: RetrieverProcess, payload: object, status: int, fragment: str) -> None:
    got, body = retrieve(server, payload)
    assert got == status and fragment in body["error"] and "\n" not in body["error"], body


def test_wrong_method_path_and_json(server: RetrieverProcess) -> None:
    assert request(server, "GET", "/retrieve")[0] == 405
    assert request(server, "POST", "/search", b"{}")[0] == 404
    status, body = request(server, "POST", "/retrieve", b"{nope")
    assert status == 400 and "not valid UTF-8 JSON" in body["error"]


@pytest.mark.parametrize("lines, fragment", [
    (['{"id": "0", "contents": "\\"A\\"\\ntext"}', '{"id": "1", "contents": '], "bad.jsonl:2: not valid JSON"),
    (['{"id": "0", "contents": "\\"A\\"\\ntext"}', "", '{"id": "2", "text": "no contents"}'],
     "bad.jsonl:3: expected an object with a string \"contents\", got keys ['id', 'text']"),
    (['["a list"]'], "bad.jsonl:1: expected an object with a string \"contents\", got a JSON list"),
    ([""], "has no documents"),
])
def test_malformed_corpus_exits_before_serving(tmp_path: Path, lines: list[str], fragment: str) -> None:
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "rlrun.retriever_server", "--corpus_path", str(corpus), "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("rlrun retriever server: error: ") and fragment in line, line
    assert "listening" not in proc.stdout


def test_missing_corpus_and_bad_flags_exit_2(tmp_path: Path) -> None:
    for args, fragment in ((["--corpus_path", str(tmp_path / "none.jsonl")], "does not exist"),
                           (["--corpus_path", str(EXAMPLE_CORPUS), "--topk", "0"], "--topk >= 1")):
        proc = subprocess.run([sys.executable, "-m", "rlrun.retriever_server", *args, "--port", "0"],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr


def test_token_start_line_and_clean_sigterm(tmp_path: Path) -> None:
    srv = start_retriever(tmp_path, extra_args=["--quiet"], env_extra={"RLRUN_RETRIEVER_TOKEN": "tok-123"})
    try:
        status, body = retrieve(srv, {"queries": ["Canberra"]})
        assert status == 401 and "RLRUN_RETRIEVER_TOKEN" in body["error"]
        status, body = request(srv, "POST", "/retrieve", json.dumps({"queries": ["Canberra"]}).encode(),
                               {"Authorization": "Bearer tok-123"})
        assert status == 200 and body["result"][0][0]["id"] == "7"
        assert request(srv, "GET", "/health")[0] == 200  # no token needed
    finally:
        assert stop_retriever(srv.proc) == 0
    out = srv.stdout_path.read_text()
    assert f"indexed 30 documents from {EXAMPLE_CORPUS}" in out
    assert f"listening on http://127.0.0.1:{srv.port} (POST /retrieve, GET /health; 30 documents" in out
    assert "bearer token required" in out and out.rstrip().endswith("stopped")
    assert srv.log() == ""  # --quiet, and never the token
