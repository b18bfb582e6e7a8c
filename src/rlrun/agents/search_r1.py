"""The Search-R1 agent (PeterGriffinJin/Search-R1, search_r1/llm_agent/generation.py) as an rlrun agent.

Each model turn ends at `</search>` or `</answer>` (SEARCH_R1_STOP, cut by the episode runner) or
at EOS / the token cap. The step then does what Search-R1's `execute_predictions` does for one row:

* `<answer>...</answer>`: the episode is done, no feedback;
* `<search>query</search>`: the retriever's top-k passages come back as
  `\n\n<information>Doc 1(Title: ...) ...</information>\n\n` (masked from the loss by the runner);
* anything else: Search-R1's "My previous action is invalid ..." message, and the episode goes on.

On the last turn no search is run (Search-R1's final `do_search=False` generation) and the episode
ends. The reward is 0 on every step but the final one, which scores Search-R1's exact match over
the whole text (prompt, actions, observations): the episode's summed reward is the EM.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from collections.abc import Callable

from rlrun.agents.api import AgentInstanceBase
from rlrun.config.agent import RETRIEVER_RETRY_BACKOFF_S
from rlrun.rewards.rules import compute_score_em, golden_answers
from rlrun.runtime.errors import ConfigError, RlrunError
from rlrun.runtime.secrets import redact_url
from rlrun.serving.http_service import AttemptFailed, RequestRejected, RetriesExhausted, post_once, with_retries
from rlrun.serving.retriever import TOKEN_ENV

# ---- the retriever client ----------------------------------------------------------------------------------------
# Client for a Search-R1 retrieval server (`python -m rlrun.retriever_server` or Search-R1's own).
#
# Concurrent `await client.search(q)` calls made in the same event-loop iteration (one turn's agents
# stepping under asyncio.gather) are coalesced into one POST of all their queries, as Search-R1's
# generation manager sends one batch per turn. The HTTP call runs in a worker thread (urllib), with
# bounded retries; a retriever that stays down, slow or malformed is one RetrieverError naming the URL.


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
        got = (
            f"{len(result)} result lists" if isinstance(result, list) else f"no 'result' list (got {str(body)[:120]!r})"
        )
        raise AttemptFailed(f"malformed response: {got} for {n} queries")
    for row in result:
        if not isinstance(row, list) or not all(
            isinstance(hit, dict)
            and isinstance(hit.get("document"), dict)
            and isinstance(hit["document"].get("contents"), str)
            for hit in row
        ):
            raise AttemptFailed(
                f"malformed response: a result is {str(row)[:120]!r}, expected a list of "
                '{"document": {"contents": "..."}, "score": ...}'
            )
    return result


class RetrieverClient:
    """Searches `url` for `topk` passages per query; one client may serve many agents and event loops."""

    def __init__(
        self,
        url: str,
        topk: int,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = RETRIEVER_RETRY_BACKOFF_S,
        max_batch: int = 256,
    ) -> None:
        if not url.lower().startswith(("http://", "https://")):
            raise ConfigError(
                f"--retriever_url {url!r} is not an http(s):// URL; pass the server's POST URL, "
                "e.g. http://127.0.0.1:8000/retrieve"
            )
        if topk < 1 or not timeout_s > 0 or retries < 1 or backoff_s < 0 or max_batch < 1:
            raise ConfigError(
                f"retriever client for {redact_url(url)}: need --retriever_topk >= 1, timeout > 0, "
                f"retries >= 1, backoff >= 0 and max_batch >= 1; got topk={topk}, timeout_s={timeout_s}, "
                f"retries={retries}, backoff_s={backoff_s}, max_batch={max_batch}"
            )
        self.url, self.source = url, redact_url(url)
        self.topk, self.timeout_s, self.retries, self.backoff_s, self.max_batch = (
            topk,
            timeout_s,
            retries,
            backoff_s,
            max_batch,
        )
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
            out += self._post(queries[start : start + self.max_batch])
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
            raise RetrieverError(
                f"retriever {self.source} rejected a batch of {len(queries)} queries: {exc}; "
                f"check the URL, the server's size limits and {TOKEN_ENV}"
            ) from None
        except RetriesExhausted as exc:
            raise RetrieverError(
                f"retriever {self.source} failed after {exc.attempts} attempts: {exc.last_error}; "
                "check that the retrieval server (python -m rlrun.retriever_server) is up and "
                "reachable from this node, or raise --retriever_timeout"
            ) from None

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
            task = loop.create_task(self._resolve(waiting[start : start + self.max_batch]))
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


SEARCH_R1_STOP = ("</search>", "</answer>")

# Search-R1's wording, verbatim (its source joins the three sentences with line continuations).
INVALID_ACTION_FEEDBACK = (
    "\nMy previous action is invalid. "
    "If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)

_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


def search_r1_prompt(question: str) -> str:
    """Search-R1's training prompt (scripts/data_process/nq_search.py, template "base"), with its question
    clean-up: stripped, and a "?" appended when missing."""
    question = question.strip()
    if not question.endswith("?"):
        question += "?"
    return (
        "Answer the given question. "
        "You must conduct reasoning inside <think> and </think> first every time you get new information. "
        "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
        "</search> and it will return the top searched results between <information> and </information>. "
        "You can search as many times as your want. "
        "If you find no further external knowledge needed, you can directly provide the answer inside <answer> "
        "and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
        f"Question: {question}\n"
    )


def cut_action(text: str) -> str:
    """Search-R1's `_postprocess_responses`: keep text up to the first `</search>` if there is one,
    else up to the first `</answer>`, else all of it."""
    for stop in SEARCH_R1_STOP:
        if stop in text:
            return text.split(stop)[0] + stop
    return text


def parse_action(text: str) -> tuple[str | None, str]:
    """Search-R1's `postprocess_predictions`: ("search" | "answer", stripped content) of the first tag pair,
    or (None, "")."""
    match = _ACTION.search(text)
    if match is None:
        return None, ""
    return match.group(1), match.group(2).strip()


def passages_to_string(hits: list[dict]) -> str:
    """Search-R1's `_passages2string`: `Doc i(Title: <first line>) <other lines>` and a newline, per hit."""
    out = ""
    for index, hit in enumerate(hits):
        lines = hit["document"]["contents"].split("\n")
        out += f"Doc {index + 1}(Title: {lines[0]}) " + "\n".join(lines[1:]) + "\n"
    return out


def information_block(hits: list[dict]) -> str:
    return f"\n\n<information>{passages_to_string(hits).strip()}</information>\n\n"


class SearchR1Agent(AgentInstanceBase):
    """One episode of Search-R1: search with `retriever`, answer, exact-match reward on the final step.

    extra_logs (every step, cumulative for the episode, as Search-R1's meta_info counters):
    searches (search actions, the last turn's unexecuted one included, = valid_search_stats),
    valid_actions, invalid_actions, answered (0/1), exact_match (0/1, set on the final step)."""

    def __init__(self, retriever: RetrieverClient) -> None:
        self.retriever = retriever
        self.counts = {
            "searches": 0.0,
            "valid_actions": 0.0,
            "invalid_actions": 0.0,
            "answered": 0.0,
            "exact_match": 0.0,
        }

    async def reset(self, states: dict, **kwargs: object) -> dict:
        label = states.get("label")
        if label is None:
            raise ValueError(
                "the Search-R1 agent needs each prompt's golden answers as its label; set "
                "--label_key to the field holding them (a string or a list of strings)"
            )
        golden_answers(label)  # a malformed label fails here, before any generation is spent on it
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs: object) -> dict:
        action_text = cut_action(states["action_text"])
        last_turn = bool(states.get("last_turn", False))
        action, content = parse_action(action_text)
        feedback, done = "", False
        if action == "answer":
            self.counts["answered"] = 1.0
            done = True
        elif action == "search":
            self.counts["searches"] += 1
            if not last_turn:
                feedback = information_block(await self.retriever.search(content))
        else:
            feedback = INVALID_ACTION_FEEDBACK
        self.counts["valid_actions" if action else "invalid_actions"] += 1
        reward = 0.0
        if done or last_turn:
            done = True
            feedback = ""  # nothing follows the final turn
            reward = compute_score_em(states["observation_text"] + action_text, states["label"])
            self.counts["exact_match"] = float(reward == 1.0)
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": feedback,
            "done": done,
            "extra_logs": dict(self.counts),
        }


def search_r1_agent_factory(url: str, topk: int, timeout_s: float, retries: int) -> Callable[[], SearchR1Agent]:
    """Makes one SearchR1Agent per episode, all sharing one RetrieverClient (so one turn's searches
    go out as one POST). Bad settings raise ConfigError here, before any rollout."""
    client = RetrieverClient(url, topk, timeout_s=timeout_s, retries=retries)

    def make() -> SearchR1Agent:
        return SearchR1Agent(client)

    return make
