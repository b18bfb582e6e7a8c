"""RetrieverClient against the real rlrun.retriever_server process, and against failing servers.

The failing servers (down: a closed port; slow: sleeps past the timeout; garbage: 200 with non-JSON
or a wrong shape; flaky: one 500 first) are a tiny http.server inside the test, because the real
server cannot be made to misbehave on purpose. Every test has a pytest timeout: none may hang.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers import refusing_port
from retriever_process import RetrieverProcess, start_retriever, stop_retriever

from rlrun.agents.search_r1 import RetrieverClient, RetrieverError
from rlrun.runtime.errors import ConfigError, RlrunError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = start_retriever(tmp_path_factory.mktemp("retriever"), extra_args=["--max_queries", "8"])
    try:
        yield srv
    finally:
        stop_retriever(srv.proc)


def top_ids(results: list[list[dict]]) -> list[str | None]:
    return [hits[0]["document"]["id"] if hits else None for hits in results]


QUERIES = ["capital of australia", "who painted the mona lisa", "zzzz", "largest planet", "titanic sink year"]
TOP_IDS = ["7", "9", None, "10", "27"]


def test_search_batch(server: RetrieverProcess) -> None:
    client = RetrieverClient(server.url, topk=2)
    results = client.search_batch(QUERIES)
    assert top_ids(results) == TOP_IDS
    assert [len(hits) for hits in results] == [2, 2, 0, 2, 1]
    assert all(isinstance(hit["score"], float) for hits in results for hit in hits)
    assert client.search_batch([]) == []


def test_concurrent_searches_are_one_post_per_loop_iteration(server: RetrieverProcess) -> None:
    client = RetrieverClient(server.url, topk=1)
    line = f"POST /retrieve -> 200 batch={len(QUERIES)} "
    before = server.wait_log_lines(line, 0)
    singles = server.wait_log_lines("POST /retrieve -> 200 batch=1 ", 0)

    async def turn() -> list[list[dict]]:
        return list(await asyncio.gather(*(client.search(q) for q in QUERIES)))

    # asyncio.run twice: a new loop per batch on the same client, as a trainer may do.
    for runs in (1, 2):
        results = asyncio.run(turn())
        assert top_ids(results) == TOP_IDS
        assert server.wait_log_lines(line, before + runs) == before + runs
    assert server.wait_log_lines("POST /retrieve -> 200 batch=1 ", 0) == singles


def test_max_batch_splits_into_several_posts(server: RetrieverProcess) -> None:
    client = RetrieverClient(server.url, topk=1, max_batch=2)
    before = server.wait_log_lines("POST /retrieve -> 200 batch=1 ", 0)

    async def turn() -> list[list[dict]]:
        return list(await asyncio.gather(*(client.search(q) for q in QUERIES)))

    assert top_ids(asyncio.run(turn())) == TOP_IDS
    assert top_ids(client.search_batch(QUERIES)) == TOP_IDS
    # 5 queries in batches of 2: 2 + 2 + 1, twice.
    assert server.wait_log_lines("POST /retrieve -> 200 batch=1 ", before + 2) == before + 2


def test_request_rejected_by_the_server_is_not_retried(server: RetrieverProcess) -> None:
    client = RetrieverClient(server.url, topk=1, retries=3, max_batch=100)
    before = server.wait_log_lines("-> 413", 0)
    with pytest.raises(RetrieverError, match=r"rejected a batch of 9 queries: HTTP 413.*over the limit of 8") as info:
        client.search_batch(["q"] * 9)
    assert server.url in str(info.value) and "\n" not in str(info.value)
    assert server.wait_log_lines("-> 413", before + 1) == before + 1


def test_token_is_sent_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = start_retriever(tmp_path, env_extra={"RLRUN_RETRIEVER_TOKEN": "tok-9"})
    try:
        monkeypatch.delenv("RLRUN_RETRIEVER_TOKEN", raising=False)
        with pytest.raises(RetrieverError, match="HTTP 401"):
            RetrieverClient(srv.url, topk=1).search_batch(["canberra"])
        monkeypatch.setenv("RLRUN_RETRIEVER_TOKEN", "tok-9")
        assert top_ids(RetrieverClient(srv.url, topk=1).search_batch(["canberra"])) == ["7"]
    finally:
        stop_retriever(srv.proc)


# -- failing servers -------------------------------------------------------------------------------

class FakeRetriever:
    """A tiny in-test server answering every POST by `mode`: slow | garbage | bad_shape | flaky."""

    def __init__(self, mode: str) -> None:
        self.mode, self.posts = mode, 0
        self.release = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.posts += 1
                if fake.mode == "slow":
                    fake.release.wait(5)
                    data = b'{"result": []}'
                elif fake.mode == "garbage":
                    data = b"<html>oops</html>"
                elif fake.mode == "bad_shape":
                    data = b'{"result": [[{"doc": 1}]]}'
                elif fake.mode == "flaky" and fake.posts == 1:
                    self.send_response(503)
                    self.send_header("Content-Length", "4")
                    self.end_headers()
                    self.wfile.write(b"busy")
                    return
                else:
                    data = json.dumps({"result": [[{"document": {"id": "x", "contents": f'"T"\n{q}'}, "score": 1.0}]
                                                  for q in body["queries"]]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/retrieve"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake(request: pytest.FixtureRequest):
    server = FakeRetriever(request.param)
    try:
        yield server
    finally:
        server.close()


def closed_port_url() -> str:
    return f"http://127.0.0.1:{refusing_port()}/retrieve"


def test_down_server_bounded_retries_then_one_error() -> None:
    url = closed_port_url()
    client = RetrieverClient(url, topk=3, retries=3, backoff_s=0.01)
    with pytest.raises(RetrieverError, match=r"failed after 3 attempts: .*[Rr]efused") as info:
        client.search_batch(["q"])
    message = str(info.value)
    assert url in message and "\n" not in message and isinstance(info.value, RlrunError)

    async def turn() -> list[object]:
        return list(await asyncio.gather(client.search("a"), client.search("b"), return_exceptions=True))

    # Every waiter of the coalesced POST gets the error; none is left waiting.
    errors = asyncio.run(turn())
    assert [type(e) for e in errors] == [RetrieverError, RetrieverError]


@pytest.mark.parametrize("fake", ["slow"], indirect=True)
def test_slow_server_times_out(fake: FakeRetriever) -> None:
    client = RetrieverClient(fake.url, topk=1, timeout_s=0.3, retries=2, backoff_s=0.01)
    with pytest.raises(RetrieverError, match=r"failed after 2 attempts: timed out after 0.3 s") as info:
        client.search_batch(["q"])
    assert fake.url in str(info.value)
    assert fake.posts == 2


@pytest.mark.parametrize("fake, fragment", [("garbage", "response is not JSON (starts with '<html>oops</html>')"),
                                            ("bad_shape", "malformed response")], indirect=["fake"])
def test_malformed_answers_are_retried_then_one_error(fake: FakeRetriever, fragment: str) -> None:
    client = RetrieverClient(fake.url, topk=1, retries=3, backoff_s=0.01)
    with pytest.raises(RetrieverError, match="failed after 3 attempts") as info:
        client.search_batch(["q"])
    assert fragment in str(info.value) and fake.url in str(info.value)
    assert fake.posts == 3


@pytest.mark.parametrize("fake", ["flaky"], indirect=True)
def test_a_5xx_is_retried_and_heals(fake: FakeRetriever) -> None:
    client = RetrieverClient(fake.url, topk=1, retries=2, backoff_s=0.01)
    [[hit]] = client.search_batch(["what"])
    assert hit["document"]["contents"] == '"T"\nwhat'
    assert fake.posts == 2


def test_bad_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="not an http"):
        RetrieverClient("127.0.0.1:8000/retrieve", topk=3)
    with pytest.raises(ConfigError, match="--retriever_topk >= 1"):
        RetrieverClient("http://127.0.0.1:8000/retrieve", topk=0)
