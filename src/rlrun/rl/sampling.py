"""An engine rank samples prompts and rewards the samples: the one `sample_and_reward` the rollouts of a step and the
evaluation share. Single responses are sampled by the engine and scored by the reward function (none when a reward
model scores the whole batch later, in the score phase); agent episodes (multi-turn) carry their own rewards."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from rlrun.agents.episodes import EpisodeSource
from rlrun.data.prompts import Prompts
from rlrun.data.vision_batch import RowVision
from rlrun.engines.protocol import Engine
from rlrun.rewards.reward_fn import RewardFunction, reward_responses


@dataclass(frozen=True)
class Rewarding:
    """How rollouts get their rewards. `reward_fn` and `agents` are an engine rank's (None elsewhere); `episodes`
    and `scored_later` every rank knows."""

    reward_fn: RewardFunction | None = None  # single responses, scored as they are sampled
    agents: EpisodeSource | None = None  # multi-turn episodes: their own rewards are the reward
    episodes: bool = False  # the rollouts are agent episodes (their masks mark the actions)
    scored_later: bool = False  # a reward model scores the batch in the score phase


@dataclass
class Sampled:
    """One engine rank's rows, as sampled and rewarded. `prompts`: the prompt ids (an episode's first turn).
    `log_probs`: the engine's for each response token (None when the backend reports none). `rewards`: [b] (None when
    a reward model scores later); `extra`: the reward function's named metrics. Agent episodes also give each token's
    action mask (0 on observations), their stats and which ended at the token budget."""

    prompts: list[list[int]]
    responses: list[list[int]]
    log_probs: list[list[float]] | None
    rewards: torch.Tensor | None = None
    extra: dict[str, float] = field(default_factory=dict)
    action_masks: list[list[int]] | None = None
    agent_stats: dict[str, float] = field(default_factory=dict)
    truncated: list[bool] | None = None
    routing: list[torch.Tensor] | None = None  # --router_replay R3: each row's experts (rlrun.models.moe)


def reward_rows(
    rewarding: Rewarding,
    prompts: Prompts,
    rows: list[int],
    responses: list[list[int]],
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The reward function's scores [b] of single responses to `prompts`' records `rows`, and its named metrics
    (reward/...); (None, {}) when a reward model scores later."""
    if rewarding.reward_fn is None:
        return None, {}
    texts, meta = [prompts.texts[i] for i in rows], prompts.meta(rows)
    result = reward_responses(rewarding.reward_fn, texts, meta, responses, tokenizer)
    return result.rewards, {f"reward/{k}": v for k, v in result.extra_logs.items()}


def sample_and_reward(
    engine: Engine,
    rewarding: Rewarding,
    prompts: Prompts,
    rows: list[int],
    prompt_ids: list[list[int]],
    seed: int,
    tokenizer: PreTrainedTokenizerBase,
    vision: RowVision | None = None,
) -> Sampled:
    """`prompts`' records `rows` (as `prompt_ids`, with a vision-language policy's `vision`) sampled from `seed`
    and rewarded: agent episodes, or single responses the reward function scores."""
    if rewarding.agents is not None:
        episodes = rewarding.agents.episodes(engine, prompts, rows, prompt_ids, seed)
        return Sampled(
            episodes.prompts,
            episodes.responses,
            episodes.log_probs,
            rewards=episodes.rewards,
            action_masks=episodes.action_masks,
            agent_stats=episodes.stats,
            truncated=list(episodes.truncated),
        )
    generation = engine.sample(prompt_ids, seed, vision=vision)
    rewards, extra = reward_rows(rewarding, prompts, rows, generation.responses, tokenizer)
    return Sampled(prompt_ids, generation.responses, generation.log_probs, rewards, extra, routing=generation.routing)
