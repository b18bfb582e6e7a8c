"""What every episode source behind the gateway shares: the training row of an episode (its first branch of ids)
and how a batch of episodes, some failed, becomes the rows the step trains on.

A failed episode trains nothing: its action mask is all zeros and its reward is the mean of its prompt group's good
episodes, so it moves neither the loss nor its group's mean; the run ends with one line when more than half of an
engine rank's episodes in a step fail.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from rlrun.agents.episodes import Episodes
from rlrun.config.agent import AgentConfig
from rlrun.config.generation import GenerationConfig
from rlrun.data.prompts import Prompts
from rlrun.engines.protocol import Engine
from rlrun.gateway.server import Gateway, Recorded, Session
from rlrun.gateway.wire import Limits
from rlrun.rewards.reward_fn import RewardFunction, reward_responses
from rlrun.runtime.errors import AgentError
from rlrun.runtime.log import get_logger
from rlrun.runtime.pyfile import one_line


@dataclass(frozen=True)
class EpisodeLimits:
    response_budget: int  # tokens of actions + observations per episode (--generate_max_len)
    prompt_max_len: int
    timeout_s: float  # one episode, start to end (--agent_timeout)
    max_concurrency: int  # episodes running at once on this engine rank (--agent_max_concurrency)
    state_masking: bool = True  # observation tokens carry no loss


def episode_limits(a: AgentConfig, g: GenerationConfig) -> EpisodeLimits:
    return EpisodeLimits(
        g.generate_max_len, g.prompt_max_len, a.agent_timeout, a.agent_max_concurrency, a.state_masking
    )


class EpisodeFailed(Exception):
    """The environment or the model's reply ended the episode: the message says why."""


@dataclass
class Outcome:
    """One episode's end: its reward, or why it failed."""

    reward: float | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # the environment's own, summed into agent/<name>


@dataclass
class Row:
    """An episode's training row, from its first branch."""

    prompt: list[int]
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    calls: int = 0
    off_branch: int = 0
    truncated: bool = False


def extend(row: Row, tokens: list[int], mask: int, log_probs: list[float], budget: int) -> None:
    """Append tokens with their mask and log-probs, up to `budget` response tokens (the rest cut, counted)."""
    room = budget - len(row.response)
    if len(tokens) > room:
        row.truncated = True
        tokens, log_probs = tokens[:room], log_probs[:room]
    row.response += tokens
    row.mask += [mask] * len(tokens)
    row.log_probs += log_probs


def branch_row(calls: list[Recorded], limits: EpisodeLimits) -> Row:
    """The row of a session's first branch: the calls that each extend the previous call's prompt and reply."""
    first = calls[0].call.prompt
    row = Row(prompt=list(first))
    context = list(first)  # the prompt + everything the branch holds so far
    for k, rec in enumerate(calls):
        prompt = rec.call.prompt
        if k and prompt[: len(context)] != context:
            row.off_branch += 1
            continue
        bridge = prompt[len(context) :]
        extend(row, bridge, 0 if limits.state_masking else 1, [0.0] * len(bridge), limits.response_budget)
        extend(row, rec.done.tokens, 1, rec.done.log_probs, limits.response_budget)
        context = prompt + rec.done.tokens
        row.calls += 1
    return row


def finish(
    built: list[Row], outcomes: list[Outcome], groups: list[str], prompt_max_len: int, pad_id: int, what: str
) -> Episodes:
    """The episodes' rows, failed ones emptied of actions; `groups[k]`: row k's prompt group (its prompt text);
    `what`: the episodes, for the one line when most failed."""
    for row, outcome in zip(built, outcomes):
        if outcome.error is None and len(row.prompt) > prompt_max_len:
            outcome.error = f"its first prompt has {len(row.prompt)} tokens, over --prompt_max_len"
    failed = [k for k, o in enumerate(outcomes) if o.error is not None]
    if len(failed) * 2 > len(outcomes):
        first = failed[0]
        raise AgentError(
            f"{len(failed)} of {len(outcomes)} {what} failed on this engine rank; the first (row {first}) "
            f"{outcomes[first].error}"
        )
    if failed:  # one line per step and engine rank: what the counted failures were
        first = failed[0]
        get_logger(int(os.environ.get("RANK", "0"))).rank_warning(
            f"{len(failed)} of {len(outcomes)} {what} failed and train nothing (agent/failed); the first (row "
            f"{first}) {outcomes[first].error}"
        )
    rewards = _rewards(outcomes, groups)
    for k in failed:  # trains nothing: no action, the row's shape kept
        row = built[k]
        row.prompt = row.prompt[-prompt_max_len:]
        row.response = row.response or [pad_id]
        row.mask, row.log_probs = [0] * len(row.response), [0.0] * len(row.response)
    stats = {
        "episodes": float(len(built)),
        "failed": float(len(failed)),
        "turns": float(sum(r.calls for r in built)),
        "calls_off_branch": float(sum(r.off_branch for r in built)),
        "budget_cut": float(sum(r.truncated for r in built)),
    }
    for outcome in outcomes:
        for name, value in outcome.metrics.items():
            stats[name] = stats.get(name, 0.0) + value
    return Episodes(
        prompts=[r.prompt for r in built],
        responses=[r.response for r in built],
        action_masks=[r.mask for r in built],
        log_probs=[r.log_probs for r in built],
        rewards=torch.tensor(rewards, dtype=torch.float32),
        truncated=[r.truncated for r in built],
        stats=stats,
    )


def add_transcript_rewards(
    reward_fn: RewardFunction,
    prompts: Prompts,
    rows: list[int],
    built: list[Row],
    outcomes: list[Outcome],
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """The run's reward function (--remote_rm_url, --compute_score) over each good episode's record and decoded
    response (replies and what the environment put between them), added to the episode's own reward."""
    good = [k for k, o in enumerate(outcomes) if o.error is None]
    if not good:
        return
    texts, meta = [prompts.texts[rows[k]] for k in good], prompts.meta([rows[k] for k in good])
    responses = [built[k].response for k in good]
    scored = reward_responses(reward_fn, texts, meta, responses, tokenizer).rewards.tolist()
    for k, value in zip(good, scored):
        outcomes[k].reward = (outcomes[k].reward or 0.0) + value


def _rewards(outcomes: list[Outcome], groups: list[str]) -> list[float]:
    """Each good episode's reward; a failed one gets the mean of its prompt group's good ones (0 when none is
    good), so that it moves neither its group's mean nor, having no action, the loss."""
    good: dict[str, list[float]] = {}
    for o, g in zip(outcomes, groups):
        if o.reward is not None and o.error is None:
            good.setdefault(g, []).append(o.reward)
    return [
        o.reward if o.reward is not None and o.error is None else sum(good.get(g, [0.0])) / len(good.get(g, [0.0]))
        for o, g in zip(outcomes, groups)
    ]


_LOOP: list[asyncio.AbstractEventLoop] = []
_LOOP_LOCK = threading.Lock()


def episode_loop() -> asyncio.AbstractEventLoop:
    """The process's one event loop for environments' episodes (in a daemon thread): verifiers keeps module-level
    asyncio locks, which belong to the first loop that takes them."""
    with _LOOP_LOCK:
        if not _LOOP:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True, name="rlrun-episodes").start()
            _LOOP.append(loop)
        return _LOOP[0]


def gateway_opener(
    a: AgentConfig, g: GenerationConfig, tokenizer: PreTrainedTokenizerBase, model: str, slot: int, max_calls: bool
) -> Callable[[], Gateway]:
    """How engine rank number `slot` opens its gateway, with its first episodes: serving `model` on --gateway_host,
    port --gateway_port + slot (a free one when --gateway_port is 0), the run's sampling settings and a call cap of
    --max_tokens_per_turn (else --generate_max_len); with `max_calls`, --max_turns calls per session."""
    cap = a.max_tokens_per_turn or g.generate_max_len
    served = Limits(model, g.temperature, g.top_p, cap, g.prompt_max_len + g.generate_max_len)

    def open_gateway() -> Gateway:
        port = a.gateway_port + slot if a.gateway_port else 0
        calls = a.max_turns if max_calls else None
        return Gateway(
            served, tokenizer, host=a.gateway_host, port=port, answer_timeout=a.agent_timeout, max_calls=calls
        )

    return open_gateway


# One episode of an in-process source: (the gateway, its session, the prompt record's index, its place in the batch).
EpisodeRun = Callable[[Gateway, Session, int, int], Coroutine[Any, Any, Outcome]]


class InProcessSessions:
    """An engine rank's gateway for episodes that run in this process (opened with the first ones: the port is taken
    on the engine rank) and the rollout phases it has served (the weight version its answers name)."""

    def __init__(self, open_gateway: Callable[[], Gateway], limits: EpisodeLimits) -> None:
        self._open_gateway, self.limits = open_gateway, limits
        self.gateway: Gateway | None = None
        self.phases = 0

    def run(
        self, engine: Engine, seed: int, rows: list[int], prompt_ids: list[list[int]], episode: EpisodeRun
    ) -> tuple[list[Row], list[Outcome]]:
        """One episode per record of `rows` on the episode loop (at most --agent_max_concurrency at once, each within
        --agent_timeout) while this thread samples their calls; each episode's row is its session's first branch
        (the record's prompt ids and no action when it made no call, which fails it)."""
        if self.gateway is None:
            self.gateway = self._open_gateway()
        gateway, limits, loop = self.gateway, self.limits, episode_loop()
        sessions = [gateway.open_session() for _ in rows]
        slots = asyncio.run_coroutine_threadsafe(_semaphore(limits.max_concurrency), loop).result()
        runs = [
            asyncio.run_coroutine_threadsafe(_bounded(slots, episode(gateway, session, i, k), limits.timeout_s), loop)
            for k, (i, session) in enumerate(zip(rows, sessions))
        ]
        gateway.serve(engine, seed, self.phases, until=lambda: all(r.done() for r in runs))
        self.phases += 1
        built, outcomes = [], []
        for ids, session, run in zip(prompt_ids, sessions, runs):
            outcome = run.result()
            built.append(branch_row(session.calls, limits) if session.calls else Row(prompt=list(ids)))
            if outcome.error is None and not session.calls:
                outcome.error = "made no model call"
            outcomes.append(outcome)
            gateway.close_session(session)
        return built, outcomes


async def _semaphore(size: int) -> asyncio.Semaphore:
    return asyncio.Semaphore(size)  # made on the loop that uses it


async def _bounded(slots: asyncio.Semaphore, episode: Coroutine[Any, Any, Outcome], timeout_s: float) -> Outcome:
    """One episode, once a slot is free, within `timeout_s`; what ends it early is its outcome's error."""
    try:
        async with slots:
            return await asyncio.wait_for(episode, timeout_s)
    except asyncio.TimeoutError:
        return Outcome(error=f"took longer than --agent_timeout {timeout_s:g}s")
    except EpisodeFailed as exc:
        return Outcome(error=str(exc))
    except Exception as exc:  # noqa: BLE001 - an environment's failure ends its episode, counted
        return Outcome(error=one_line(exc)[:300])


async def in_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` on a daemon thread of its own, awaited: a user's blocking call (an environment's reset
    or tool) that outlives --agent_timeout is abandoned there and never holds up the process's exit, as a pool
    thread would."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is None:
            done.set_result(value)
        else:
            done.set_exception(error)

    def work() -> None:
        try:
            value, error = fn(*args, **kwargs), None
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting episode
            value, error = None, exc
        loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=work, daemon=True, name="rlrun-env-call").start()
    return await done
