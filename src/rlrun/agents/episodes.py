"""Multi-turn episodes on an engine rank: generate a turn for every open episode at once, let each
episode's agent answer it (concurrently, asyncio), append the answer as observation tokens, repeat.

Turn-synchronous batching (as Search-R1's generation manager) works with any backend's batch
`sample()`, HF or vLLM. Per episode the response region is

    action tokens (mask 1) | observation tokens (mask 0) | action tokens (mask 1) | ...

capped at `response_budget` tokens in all; the episode's reward is the sum of its agent's step
rewards (OpenRLHF's MultiTurnAgentExecutor). Observation tokens get engine log-prob 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, cast

import torch
from transformers import PreTrainedTokenizerBase

from rlrun.agents.calls import AgentCalls, Instance
from rlrun.agents.loader import load_agent_file
from rlrun.config.agent import AgentConfig
from rlrun.config.generation import GenerationConfig
from rlrun.data.batching import derive_seed
from rlrun.data.prompts import Prompts
from rlrun.engines.protocol import Engine, Generation
from rlrun.runtime.errors import AgentError


class _Sampler(Protocol):
    def sample(
        self, prompts: list[list[int]], seed: int, *, max_new_tokens: int | None = None, stop: tuple[str, ...] = ()
    ) -> Generation: ...


@dataclass(frozen=True)
class TurnLimits:
    response_budget: int  # tokens of actions + observations per episode (--generate_max_len)
    prompt_max_len: int  # a reset() observation longer than this keeps its last tokens
    max_turns: int | None = None
    max_tokens_per_turn: int | None = None
    max_obs_len: int | None = None
    state_masking: bool = True
    stop: tuple[str, ...] = ()


@dataclass
class _Episode:
    prompt: list[int]
    text: str  # everything so far as text: the observation_text of the next step
    label: str | None
    response: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    observations: int = 0
    obs_truncated: int = 0
    budget_cut: bool = False
    extra_logs: dict[str, float] = field(default_factory=dict)


@dataclass
class Episodes:
    """One batch of finished episodes, row i from prompt i.

    prompts[i]: prompt ids (reset()'s observation, left-truncated to prompt_max_len);
    responses[i]: actions and observations; action_masks[i]: 1 on tokens the loss trains on;
    log_probs[i]: engine log-probs (0 on observations) or None; rewards: [b] float32;
    truncated[i]: the token budget ended the episode; stats: per-batch sums (see stat_sums)."""

    prompts: list[list[int]]
    responses: list[list[int]]
    action_masks: list[list[int]]
    log_probs: list[list[float]] | None
    rewards: torch.Tensor
    truncated: list[bool]
    stats: dict[str, float]


def stat_sums(episodes: list[_Episode]) -> dict[str, float]:
    """Sums over episodes (merged across engine ranks by adding, then divided by "episodes"): the agent's
    last extra_logs (OpenRLHF keeps the last step's) and rlrun's own turn counts."""
    out: dict[str, float] = {"episodes": float(len(episodes))}

    def add(key: str, value: float) -> None:
        out[key] = out.get(key, 0.0) + value

    for e in episodes:
        add("turns", e.turns)
        add("observation_tokens", len(e.mask) - sum(e.mask) if e.mask else 0)
        add("obs_truncated", e.obs_truncated)
        add("budget_cut", float(e.budget_cut))
        for k, v in e.extra_logs.items():
            add(k, v)
    return out


def mean_stats(sums: list[dict[str, float]]) -> dict[str, float]:
    """agent/<name>: per-episode means over all engine ranks' stat_sums."""
    total: dict[str, float] = {}
    for s in sums:
        for k, v in s.items():
            total[k] = total.get(k, 0.0) + v
    n = total.pop("episodes", 0.0)
    return {f"agent/{k}": v / n for k, v in sorted(total.items())} if n else {}


class EpisodeSource(Protocol):
    """Where an engine rank's multi-turn episodes come from: OpenRLHF agent classes and Search-R1 (EpisodeRunner),
    or agent programs behind the gateway (rlrun.environments.programs)."""

    def episodes(
        self, engine: Engine, prompts: Prompts, rows: list[int], prompt_ids: list[list[int]], seed: int
    ) -> Episodes:
        """One episode per row: `prompts`' records `rows` (tokenised as `prompt_ids`), sampled from `seed`."""
        ...


class EpisodeRunner:
    """Runs episodes with one agent instance each (made by `factory`), on whatever engine it is given."""

    def __init__(
        self, factory: Callable[[], Instance], tokenizer: PreTrainedTokenizerBase, limits: TurnLimits, calls: AgentCalls
    ) -> None:
        self.factory, self.tokenizer, self.limits, self.calls = factory, tokenizer, limits, calls

    def episodes(
        self, engine: Engine, prompts: Prompts, rows: list[int], prompt_ids: list[list[int]], seed: int
    ) -> Episodes:
        texts, labels = [prompts.texts[i] for i in rows], prompts.meta(rows).labels
        return self.run(engine, texts, prompt_ids, labels, seed)

    def run(
        self,
        engine: _Sampler,
        prompt_texts: list[str],
        prompt_ids: list[list[int]],
        labels: list[str | None],
        seed: int,
    ) -> Episodes:
        lim = self.limits
        agents = self.calls.construct(self.factory, len(prompt_texts))
        episodes = [
            self._start(text, ids, label, reset)
            for text, ids, label, reset in zip(
                prompt_texts, prompt_ids, labels, self.calls.reset(agents, prompt_texts, labels)
            )
        ]
        open_rows = list(range(len(episodes)))
        turn, engine_log_probs = 0, True
        while open_rows:
            room = {i: lim.response_budget - len(episodes[i].response) for i in open_rows}
            caps = {i: min(room[i], lim.max_tokens_per_turn or room[i]) for i in open_rows}
            generation = engine.sample(
                [episodes[i].prompt + episodes[i].response for i in open_rows],
                derive_seed(seed, "turn", turn),
                max_new_tokens=max(caps.values()),
                stop=lim.stop,
            )
            engine_log_probs = engine_log_probs and generation.log_probs is not None
            actions: list[str] = []
            for k, i in enumerate(open_rows):
                tokens = generation.responses[k][: caps[i]]
                lps = (
                    generation.log_probs[k][: len(tokens)] if generation.log_probs is not None else [0.0] * len(tokens)
                )
                e = episodes[i]
                e.response += tokens
                e.mask += [1] * len(tokens)
                e.log_probs += lps
                e.turns += 1
                # one row of ids decodes to one text (transformers types decode for a batch too)
                actions.append(cast(str, self.tokenizer.decode(tokens, skip_special_tokens=True)))
            last = [turn + 1 == lim.max_turns or len(episodes[i].response) >= lim.response_budget for i in open_rows]
            results = self.calls.step(
                agents,
                open_rows,
                [episodes[i].text for i in open_rows],
                actions,
                [episodes[i].label for i in open_rows],
                turn,
                last,
            )
            still_open = []
            for i, action, is_last, result in zip(open_rows, actions, last, results):
                e = episodes[i]
                e.reward += result.reward
                e.extra_logs = result.extra_logs
                e.text += action + result.feedback
                if result.done or is_last:
                    e.budget_cut = is_last and not result.done and turn + 1 != lim.max_turns
                    continue
                if self._observe(e, result.feedback):
                    still_open.append(i)
            open_rows = still_open
            turn += 1
        return self._finish(episodes, engine_log_probs)

    def _start(self, prompt_text: str, prompt_ids: list[int], label: str | None, observation: str) -> _Episode:
        """The episode's prompt: the tokenised prompt unless reset() changed the observation text."""
        ids = prompt_ids if observation == prompt_text else self.tokenizer.encode(observation, add_special_tokens=False)
        return _Episode(prompt=ids[-self.limits.prompt_max_len :], text=observation, label=label)

    def _observe(self, e: _Episode, feedback: str) -> bool:
        """Append the observation; False when the token budget is used up (the episode ends there)."""
        lim = self.limits
        ids = self.tokenizer.encode(feedback, add_special_tokens=False) if feedback else []
        if lim.max_obs_len is not None and len(ids) > lim.max_obs_len:
            e.obs_truncated += 1
            ids = ids[: lim.max_obs_len]
        room = lim.response_budget - len(e.response)
        if len(ids) >= room:
            e.budget_cut = True
            ids = ids[:room]
        e.response += ids
        e.mask += [0 if lim.state_masking else 1] * len(ids)
        e.log_probs += [0.0] * len(ids)
        e.observations += 1
        return not e.budget_cut

    def _finish(self, episodes: list[_Episode], engine_log_probs: bool) -> Episodes:
        for e in episodes:
            if not math.isfinite(e.reward):
                raise AgentError(
                    f"agent rewards summed to {e.reward} for an episode of {e.turns} turns; "
                    "every step's rewards must be finite numbers"
                )
        return Episodes(
            prompts=[e.prompt for e in episodes],
            responses=[e.response for e in episodes],
            action_masks=[e.mask for e in episodes],
            log_probs=[e.log_probs for e in episodes] if engine_log_probs else None,
            rewards=torch.tensor([e.reward for e in episodes], dtype=torch.float32),
            truncated=[e.budget_cut for e in episodes],
            stats=stat_sums(episodes),
        )


# ---- the episode runner ------------------------------------------------------------------------------------------
# The run's episode runner from its config: an OpenRLHF agent file, or the built-in Search-R1 agent.


def build_episode_runner(
    a: AgentConfig, g: GenerationConfig, tokenizer: PreTrainedTokenizerBase, retries: int
) -> EpisodeRunner:
    """The run's episode runner: an OpenRLHF agent file, or the built-in Search-R1 agent (its retrieval requests
    tried `retries` times, --remote_rm_retries)."""
    stop: tuple[str, ...]
    if a.agent_func_path is not None:
        # OpenRLHF's turns end at EOS or the token cap; an agent file has no stop strings.
        factory, stop, source = load_agent_file(a.agent_func_path), (), a.agent_func_path
    else:
        from rlrun.agents.search_r1 import SEARCH_R1_STOP, search_r1_agent_factory  # noqa: PLC0415

        assert a.retriever_url is not None
        factory = search_r1_agent_factory(a.retriever_url, a.retriever_topk, a.retriever_timeout, retries)
        stop, source = SEARCH_R1_STOP, "search_r1"
    limits = TurnLimits(
        response_budget=g.generate_max_len,
        prompt_max_len=g.prompt_max_len,
        max_turns=a.max_turns,
        max_tokens_per_turn=a.max_tokens_per_turn,
        max_obs_len=a.max_obs_len,
        state_masking=a.state_masking,
        stop=stop,
    )
    calls = AgentCalls(timeout_s=a.agent_timeout, max_concurrency=a.agent_max_concurrency, source=source)
    return EpisodeRunner(factory, tokenizer, limits, calls)
