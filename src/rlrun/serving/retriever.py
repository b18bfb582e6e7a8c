"""A BM25 retrieval server speaking Search-R1's protocol, for `--retriever_url http://HOST:PORT/retrieve`.

    python -m rlrun.retriever_server --corpus_path corpus.jsonl --host 127.0.0.1 --port 8000 --topk 3

The corpus is Search-R1's JSONL: one object a line with "contents" = '"Title"\\ntext' (and usually
"id"); a BM25 index (bm25s) over "contents" is built at start, before serving.

POST /retrieve  {"queries": [...], "topk": 3, "return_scores": true}
                -> 200 {"result": [[{"document": {"id": ..., "contents": ...}, "score": 1.7}, ...], ...]}
                   (return_scores false or missing: {"result": [[{"id": ..., "contents": ...}, ...], ...]})
GET  /health    -> 200 {"status": "ok", "documents": N}

As Search-R1's server: a missing or null topk means --topk (0, which Search-R1 also reads as the default,
is a 400 here); "document" is the corpus record as
read. As Lucene (Search-R1's BM25 backend), only documents sharing a term with the query are hits,
so a query can get fewer than topk results (or none). All queries of one request are scored in one
bm25s call. Limits: over --max_queries queries or --max_request_bytes bytes -> 413, a query over
--max_query_chars characters -> 400. Set RLRUN_RETRIEVER_TOKEN to require a bearer token (the
client sends it from the same variable). Errors are JSON `{"error": "..."}`, one line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path

from rlrun.runtime.errors import MissingExtraError, RlrunError
from rlrun.serving.http_service import (
    BadRequest,
    JsonHandler,
    JsonHTTPServer,
    add_server_arguments,
    serve,
    server_arguments_error,
)

TOKEN_ENV = "RLRUN_RETRIEVER_TOKEN"
# Pyserini's BM25 defaults (Search-R1 serves BM25 through pyserini's LuceneSearcher).
BM25_K1 = 0.9
BM25_B = 0.4
_LINE_FORMAT = 'each line must be one object like {"id": "0", "contents": "\\"Title\\"\\ntext"}.'


class CorpusError(RlrunError, ValueError):
    """The retrieval corpus is missing, empty or has a malformed line."""


def load_corpus(path: Path) -> list[dict]:
    """Read a Search-R1 corpus: one JSON object with a string "contents" per non-blank line."""
    if not path.is_file():
        raise CorpusError(
            f"corpus file {path} does not exist; pass --corpus_path a JSONL file with one "
            '{"id": ..., "contents": "\\"Title\\"\\ntext"} per line.'
        )
    docs: list[dict] = []
    with path.open("rb") as lines:  # bytes, so that an encoding error is reported with its line
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            try:
                doc = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise CorpusError(
                    f"{path}:{number}: not UTF-8 ({exc.reason} at byte {exc.start}); save the corpus as UTF-8 JSONL."
                ) from None
            except json.JSONDecodeError as exc:
                raise CorpusError(
                    f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno}); {_LINE_FORMAT}"
                ) from None
            if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
                what = f"keys {sorted(doc)}" if isinstance(doc, dict) else f"a JSON {type(doc).__name__}"
                raise CorpusError(
                    f'{path}:{number}: expected an object with a string "contents", got {what}; {_LINE_FORMAT}'
                )
            docs.append(doc)
    if not docs:
        raise CorpusError(f'corpus file {path} has no documents; it needs at least one JSON line with "contents".')
    return docs


@dataclass(frozen=True)
class Hit:
    document: dict
    score: float


class Bm25Index:
    """BM25 over the documents' "contents" (bm25s, English stopwords, no stemming)."""

    def __init__(self, docs: list[dict]) -> None:
        try:
            import bm25s  # noqa: PLC0415 - optional extra (rlrun[search])
        except ImportError as exc:
            raise MissingExtraError("bm25s", "search", "python -m rlrun.retriever_server") from exc
        self._bm25s = bm25s
        self.docs = docs
        tokens = bm25s.tokenize([doc["contents"] for doc in docs], stopwords="en", show_progress=False)
        self._index = bm25s.BM25(k1=BM25_K1, b=BM25_B)
        self._index.index(tokens, show_progress=False)
        # bm25s keeps per-call scratch state; requests arrive on several threads.
        self._lock = threading.Lock()

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """The best min(topk, documents) hits per query, best first; documents without a query term are
        dropped, as Lucene does."""
        if not queries:
            return []
        k = min(topk, len(self.docs))
        tokens = self._bm25s.tokenize(queries, stopwords="en", return_ids=False, show_progress=False)
        with self._lock:
            ids, scores = self._index.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [
            [Hit(self.docs[int(i)], float(s)) for i, s in zip(row_ids, row_scores) if s > 0]
            for row_ids, row_scores in zip(ids.tolist(), scores.tolist())
        ]


@dataclass(frozen=True)
class RetrieveRequest:
    queries: list[str]
    topk: int
    return_scores: bool


def parse_request(payload: object, *, default_topk: int, max_queries: int, max_query_chars: int) -> RetrieveRequest:
    """Validate a Search-R1 retrieval request against the server's limits."""
    if not isinstance(payload, dict):
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"request body must be a JSON object, got {type(payload).__name__}")
    unknown = sorted(set(payload) - {"queries", "topk", "return_scores"})
    if unknown:
        raise BadRequest(
            HTTPStatus.BAD_REQUEST, f"unknown key(s) {unknown}; expected 'queries', 'topk', 'return_scores'"
        )
    queries = payload.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "'queries' must be a list of strings")
    if len(queries) > max_queries:
        raise BadRequest(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"{len(queries)} queries in one request is over the limit of {max_queries}; "
            "send smaller batches or raise --max_queries",
        )
    long = [i for i, q in enumerate(queries) if len(q) > max_query_chars]
    if long:
        raise BadRequest(
            HTTPStatus.BAD_REQUEST,
            f"query [{long[0]}] has {len(queries[long[0]])} characters, over the limit of "
            f"{max_query_chars} ({len(long)} such queries); shorten it or raise --max_query_chars",
        )
    topk = payload.get("topk")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
        # Search-R1's server reads 0 as "the default"; a client asking for zero passages has a bug worth seeing.
        raise BadRequest(
            HTTPStatus.BAD_REQUEST,
            f"'topk' must be a positive integer, got {topk!r}; omit it or send null for the server's --topk",
        )
    return_scores = payload.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"'return_scores' must be true or false, got {return_scores!r}")
    return RetrieveRequest(queries=queries, topk=default_topk if topk is None else topk, return_scores=return_scores)


@dataclass(frozen=True)
class RetrievalLimits:
    """What one /retrieve request gets by default and may ask at most (--topk, --max_queries, --max_query_chars)."""

    topk: int
    max_queries: int
    max_query_chars: int


class RetrieverHTTPServer(JsonHTTPServer):
    def __init__(
        self,
        address: tuple[str, int],
        index: Bm25Index,
        limits: RetrievalLimits,
        *,
        token: str | None,
        max_request_bytes: int,
        request_timeout: float,
        quiet: bool,
    ) -> None:
        self.index = index
        self.topk = limits.topk
        self.max_queries = limits.max_queries
        self.max_query_chars = limits.max_query_chars
        super().__init__(
            address,
            RetrieverHandler,
            log_name="retriever-server",
            token=token,
            token_env=TOKEN_ENV,
            max_request_bytes=max_request_bytes,
            request_timeout=request_timeout,
            quiet=quiet,
        )


class RetrieverHandler(JsonHandler):
    server: RetrieverHTTPServer
    server_version = "rlrun-retriever-server"
    post_paths = ("/retrieve",)

    def health(self) -> dict:
        return {"status": "ok", "documents": len(self.server.index.docs)}

    def handle_post(self, path: str, payload: object) -> tuple[dict, int | None]:
        request = parse_request(
            payload,
            default_topk=self.server.topk,
            max_queries=self.server.max_queries,
            max_query_chars=self.server.max_query_chars,
        )
        hits = self.server.index.search(request.queries, request.topk)
        if request.return_scores:
            result: list = [[{"document": hit.document, "score": hit.score} for hit in row] for row in hits]
        else:
            result = [[hit.document for hit in row] for row in hits]
        return {"result": result}, len(request.queries)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rlrun.retriever_server",
        description="Serve BM25 retrieval over a Search-R1 JSONL corpus at POST /retrieve "
        "(Search-R1's request and response format) for --retriever_url.",
    )
    parser.add_argument(
        "--corpus_path",
        required=True,
        help='JSONL corpus, one {"id": ..., "contents": "\\"Title\\"\\ntext"} per line (Search-R1 format).',
    )
    parser.add_argument(
        "--topk", type=int, default=3, help="Documents per query when a request gives no topk (default: 3)."
    )
    parser.add_argument(
        "--max_queries", type=int, default=256, help="Most queries in one request; more get 413 (default: 256)."
    )
    parser.add_argument(
        "--max_query_chars",
        type=int,
        default=2000,
        help="Longest accepted query in characters; longer ones get 400 (default: 2000).",
    )
    add_server_arguments(parser, default_port=8000)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    prog = "rlrun retriever server"
    args = build_parser().parse_args(argv)
    problem = server_arguments_error(args)
    if problem is None and (args.topk < 1 or args.max_queries < 1 or args.max_query_chars < 1):
        problem = "need --topk >= 1, --max_queries >= 1 and --max_query_chars >= 1"
    if problem:
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        docs = load_corpus(Path(args.corpus_path).expanduser())
        index = Bm25Index(docs)
    except (CorpusError, MissingExtraError, OSError) as exc:
        print(f"{prog}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(
        f"{prog}: indexed {len(docs)} documents from {args.corpus_path} in {time.monotonic() - started:.1f} s",
        flush=True,
    )
    token = os.environ.get(TOKEN_ENV) or None
    return serve(
        prog,
        lambda: RetrieverHTTPServer(
            (args.host, args.port),
            index,
            RetrievalLimits(args.topk, args.max_queries, args.max_query_chars),
            token=token,
            max_request_bytes=args.max_request_bytes,
            request_timeout=args.request_timeout,
            quiet=args.quiet,
        ),
        host=args.host,
        port=args.port,
        details=f"POST /retrieve, GET /health; {len(docs)} documents from {args.corpus_path}, BM25 topk {args.topk}",
        exposes="search the corpus",
    )
