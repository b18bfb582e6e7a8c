"""Client for a Search-R1 retrieval server (`python -m rlrun.retriever_server` or Search-R1's own).

Concurrent `await client.search(q)` calls made in the same event-loop iteration (one turn's agents
stepping under asyncio.gather) are coalesced into one POST of all their queries, as Search-R1's
generation manager sends one batch per turn. The HTTP call runs in a worker thread (urllib), with
bounded retries; a retriever that stays down, slow or malformed is one RetrieverError naming the URL.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading

from rlrun.config.rl_sections import RETRIEVER_RETRY_BACKOFF_S
from rlrun.runtime.errors import ConfigError, RlrunError
from rlrun.runtime.secrets import redact_url
from rlrun.serving.http_retry import AttemptFailed, RequestRejected, RetriesExhausted, post_once, with_retries
from rlrun.serving.retriever import TOKEN_ENV


class RetrieverError(RlrunError):
    """The retrieval server could not answer: unreachable, timing out, failing or malformed after all retries."""


def _check_result(payload: bytes, n: int) -> list[list[dict]]:
    """Search-R1's `{"result": [[{"document": {"contents": str, ...}, "score": x}, ...] * n]}`, or AttemptFailed."""
    try:
        body = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        snippet = " ".join(payload[:120].decode("utf-8", "replace").split())
        raise AttemptFailed(f"response is not JSON (starts with {snippet!r})") from None
    result = body.get("result") if isinstance(body, dict) else None
    if not isinstance(result, list) or len(result) != n:
        got = f"{len(result)} result lists" if isinstance(result, list) else f"no 'result' list (got {str(body)[:120]!r})"
        raise AttemptFailed(f"malformed response: {got} for {n} queries")
    for row in result:
        if not isinstance(row, list) or not all(
                isinstance(hit, dict) and isinstance(hit.get("document"), dict)
                and isinstance(hit["document"].get("contents"), str) for hit in row):
            raise AttemptFailed(f"malformed response: a result is {str(row)[:120]!r}, expected a list of "
                                '{"document": {"contents": "..."}, "score": ...}')
    return result


class RetrieverClient:
    """Searches `url` for `topk` passages per query; one client may serve many agents and event loops."""

    def __init__(self, url: str, topk: int, *, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = RETRIEVER_RETRY_BACKOFF_S,
                 max_batch: int = 256) -> None:
        if not url.lower().startswith(("http://", "https://")):
            raise ConfigError(f"--retriever_url {url!r} is not an http(s):// URL; pass the server's POST URL, "
                              "e.g. http://127.0.0.1:8000/retrieve")
        if topk < 1 or not timeout_s > 0 or retries < 1 or backoff_s < 0 or max_batch < 1:
            raise ConfigError(f"retriever client for {redact_url(url)}: need --retriever_topk >= 1, timeout > 0, "
                              f"retries >= 1, backoff >= 0 and max_batch >= 1; got topk={topk}, timeout_s={timeout_s}, "
                              f"retries={retries}, backoff_s={backoff_s}, max_batch={max_batch}")
        self.url, self.source = url, redact_url(url)
        self.topk, self.timeout_s, self.retries, self.backoff_s, self.max_batch = (
            topk, timeout_s, retries, backoff_s, max_batch)
        # Queries waiting for their loop's next flush. Keyed by loop, never bound at construction:
        # asyncio.run may make a new loop per batch, and several loops (threads) may share the client.
        self._pending: dict[asyncio.AbstractEventLoop, list[tuple[str, asyncio.Future]]] = {}
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Task] = set()  # flush tasks, referenced until done

    def __repr__(self) -> str:
        return f"RetrieverClient({self.source!r}, topk={self.topk})"

    # -- sync ----------------------------------------------------------------------------------
    def search_batch(self, queries: list[str]) -> list[list[dict]]:
        """Search-R1 result lists, one per query ({"document": {...}, "score": x} each), in POSTs of at
        most max_batch queries. Blocks; raises RetrieverError."""
        out: list[list[dict]] = []
        for start in range(0, len(queries), self.max_batch):
            out += self._post(queries[start:start + self.max_batch])
        return out

    def _post(self, queries: list[str]) -> list[list[dict]]:
        token = os.environ.get(TOKEN_ENV) or None  # read per call so a rotated token is picked up

        def scrub(text: str) -> str:
            return text.replace(token, "<token>") if token else text

        body = json.dumps({"queries": queries, "topk": self.topk, "return_scores": True}).encode("utf-8")
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"

        def attempt() -> list[list[dict]]:
            _, payload = post_once(self.url, body, headers, self.timeout_s, scrub)
            return _check_result(payload, len(queries))

        try:
            return with_retries(attempt, retries=self.retries, backoff_s=self.backoff_s)
        except RequestRejected as exc:
            raise RetrieverError(f"retriever {self.source} rejected a batch of {len(queries)} queries: {exc}; "
                                 f"check the URL, the server's size limits and {TOKEN_ENV}") from None
        except RetriesExhausted as exc:
            raise RetrieverError(f"retriever {self.source} failed after {exc.attempts} attempts: {exc.last_error}; "
                                 "check that the retrieval server (python -m rlrun.retriever_server) is up and "
                                 "reachable from this node, or raise --retriever_timeout") from None

    # -- async ---------------------------------------------------------------------------------
    async def search(self, query: str) -> list[dict]:
        """The result list for one query; calls of the same loop iteration share one POST."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        with self._lock:
            waiting = self._pending.setdefault(loop, [])
            first = not waiting
            waiting.append((query, future))
        if first:
            # Runs after every callback already queued, i.e. after the other agents of this turn
            # have reached their own search() call.
            loop.call_soon(self._flush, loop)
        return await future

    def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            waiting = self._pending.pop(loop, [])
        for start in range(0, len(waiting), self.max_batch):
            task = loop.create_task(self._resolve(waiting[start:start + self.max_batch]))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _resolve(self, batch: list[tuple[str, asyncio.Future]]) -> None:
        try:
            results = await asyncio.to_thread(self._post, [query for query, _ in batch])
        except Exception as exc:  # noqa: BLE001 - every waiter gets the failure, none is left hanging
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), result in zip(batch, results):
            if not future.done():  # a cancelled waiter
                future.set_result(result)
