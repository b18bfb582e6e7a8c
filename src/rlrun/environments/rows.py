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
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from rlrun.agents.episodes import Episodes
from rlrun.config.agent import AgentConfig
from rlrun.config.generation import GenerationConfig
from rlrun.gateway.server import Gateway
from rlrun.gateway.wire import Limits
from rlrun.runtime.errors import AgentError
from rlrun.runtime.log import get_logger


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
