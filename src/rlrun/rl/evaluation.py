"""Evaluation during training: sample --eval_dataset on the engine ranks, reward it, log eval/ metrics.

Metrics follow OpenRLHF 0.11.2 (trainer/ppo_trainer.py compute_eval_metrics), with rlrun's names:

* ``eval/reward``: mean reward over all samples (OpenRLHF ``eval_<source>_pass1``: the mean over prompts of the
  mean of each prompt's N rewards, the same number since every prompt has N samples);
* ``eval/pass@N`` (N = --eval_n_samples_per_prompt, only when N > 1): mean over prompts of the best of its N
  rewards (OpenRLHF ``eval_<source>_passN``); for 0/1 rewards, the fraction of prompts solved by any sample;
* ``eval/response_length``: mean response tokens (EOS included); ``eval/truncated_rate``: fraction of responses
  that hit --generate_max_len without EOS; ``eval/num_samples``; ``eval/time``.

Randomness: generation draws from seeds derived from (seed, "eval", step, engine slot, chunk) inside the engine's
own forked RNG, and every training step reseeds all RNGs at its start, so evaluating never changes training.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from rlrun.agents.episodes import EpisodeRunner
from rlrun.algo.algorithms import cut_by_length
from rlrun.config.evaluation import EvalConfig
from rlrun.config.tracking import TrackingConfig
from rlrun.config.training import TrainConfig
from rlrun.data.batching import derive_seed
from rlrun.data.prompts import Prompts
from rlrun.engines.base import Engine, SamplingSettings
from rlrun.launch.groups import Groups
from rlrun.launch.layout import Layout, Role
from rlrun.launch.transfer import all_gather_vectors
from rlrun.rewards.reward_fn import PromptMeta, RewardFunction, reward_responses

# Per-rank sums, added over engine ranks: [sum of per-prompt mean rewards, sum of per-prompt max rewards,
# prompts, sum of response lengths, samples, truncated samples].
TOTALS = 6


def prompt_slice(num_prompts: int, num_slots: int, slot: int) -> slice:
    """Balanced contiguous share of the eval prompts for engine slot `slot` (sizes differ by at most one)."""
    return slice(slot * num_prompts // num_slots, (slot + 1) * num_prompts // num_slots)


def local_totals(rewards: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """rewards, lengths, truncated: [P, N] (P prompts of this rank, N samples each) -> [TOTALS] float64 sums."""
    if rewards.shape[0] == 0:
        return torch.zeros(TOTALS, dtype=torch.float64)
    r = rewards.double()
    return torch.stack(
        [
            r.mean(dim=1).sum(),
            r.max(dim=1).values.sum(),
            torch.tensor(float(r.shape[0]), dtype=torch.float64),
            lengths.double().sum(),
            torch.tensor(float(r.numel()), dtype=torch.float64),
            truncated.double().sum(),
        ]
    )


def finalize(per_rank: torch.Tensor, n_samples: int) -> dict[str, float]:
    """[ranks, TOTALS] sums (rows of non-engine ranks are zero) -> the eval/ metrics; rank order fixes the sum."""
    t = per_rank.double().sum(dim=0)
    prompts, samples = float(t[2]), float(t[4])
    out = {"eval/reward": float(t[0]) / prompts}
    if n_samples > 1:
        out[f"eval/pass@{n_samples}"] = float(t[1]) / prompts
    out["eval/response_length"] = float(t[3]) / samples
    out["eval/truncated_rate"] = float(t[5]) / samples
    out["eval/num_samples"] = samples
    return out


class Evaluator:
    """Collective: every rank calls run(); engine ranks sample and reward their share, all receive the metrics."""

    def __init__(
        self,
        ev: EvalConfig,
        tracking: TrackingConfig,
        train: TrainConfig,
        prompt_max_len: int,
        layout: Layout,
        groups: Groups,
        prompts: Prompts,
        tokenizer: PreTrainedTokenizerBase,
        comm_device: torch.device,
        *,
        engine: Engine | None,
        reward_fn: RewardFunction | None,
        agents: EpisodeRunner | None,
    ) -> None:
        self.groups, self.prompts, self.tokenizer = groups, prompts, tokenizer
        self.seed, self.prompt_max_len = train.seed, prompt_max_len
        self.comm_device = comm_device
        self.every, self.before_train, self.n = (
            tracking.eval_steps,
            tracking.eval_before_train,
            ev.eval_n_samples_per_prompt,
        )
        self.engine_ranks = layout.ranks_of(Role.ENGINE)
        self.engine, self.reward_fn, self.agents = engine, reward_fn, agents  # an engine rank's, else None
        self.temperature = ev.eval_temperature
        # Rows per generate call: what one engine rank generates per training step, which is known to fit.
        self.chunk_rows = max(self.n, train.rollouts_per_step // max(1, len(self.engine_ranks)))

    def due(self, steps_done: int) -> bool:
        return self.every > 0 and steps_done % self.every == 0

    def run(self, steps_done: int) -> dict[str, float]:
        start = time.perf_counter()
        totals = torch.zeros(TOTALS, dtype=torch.float64)
        if self.engine is not None:
            slot = self.engine_ranks.index(self.groups.rank)
            mine = list(range(len(self.prompts.ids)))[prompt_slice(len(self.prompts.ids), len(self.engine_ranks), slot)]
            with _sampling(self.engine, temperature=self.temperature):
                totals = self._sample_and_score(mine, steps_done, slot)
        per_rank = all_gather_vectors(totals.to(self.comm_device), self.groups.world).cpu()
        out = finalize(per_rank, self.n)
        out["eval/time"] = time.perf_counter() - start
        return out

    def _sample_and_score(self, indices: list[int], steps_done: int, slot: int) -> torch.Tensor:
        assert self.engine is not None
        rows = [i for i in indices for _ in range(self.n)]  # each prompt's N samples stay adjacent
        per_chunk = max(self.n, self.chunk_rows // self.n * self.n)  # whole prompts per chunk
        rewards, lengths, truncated = [], [], []
        for chunk, begin in enumerate(range(0, len(rows), per_chunk)):
            part = rows[begin : begin + per_chunk]
            seed = derive_seed(self.seed, "eval", steps_done, slot, chunk)
            r, n, cut = self._chunk(
                part,
                [self.prompts.texts[i] for i in part],
                [self.prompts.ids[i] for i in part],
                self.prompts.meta(part),
                seed,
            )
            rewards.append(r)
            lengths.append(n)
            truncated.append(cut)
        if not rows:
            return local_totals(torch.zeros(0, self.n), torch.zeros(0, self.n), torch.zeros(0, self.n))
        shape = (len(indices), self.n)
        return local_totals(
            torch.cat(rewards).view(shape), torch.cat(lengths).view(shape), torch.cat(truncated).view(shape)
        )

    def _chunk(
        self, rows: list[int], texts: list[str], ids: list[list[int]], meta: PromptMeta, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rewards [b], response lengths [b], truncated [b]) of one generate call, or of one batch of agent
        episodes (length = actions and observations; truncated = ended by the token budget)."""
        assert self.engine is not None
        if self.agents is not None:
            episodes = self.agents.run(self.engine, texts, ids, meta.labels, seed)
            return (
                episodes.rewards.float(),
                torch.tensor([len(r) for r in episodes.responses]),
                torch.tensor(episodes.truncated),
            )
        assert self.reward_fn is not None
        images: dict[str, Any] = {}  # VLM engines' vision=
        if self.prompts.images is not None:
            ids, vision = self.prompts.with_images(rows, self.prompt_max_len)
            images = {"vision": vision}
        responses = self.engine.sample(ids, seed, **images).responses
        result = reward_responses(self.reward_fn, texts, meta, responses, self.tokenizer)
        length = torch.tensor([len(r) for r in responses])
        last = torch.tensor([r[-1] if r else -1 for r in responses])
        s = self.engine.sampling
        return result.rewards.float(), length, cut_by_length(last, length, s.max_new_tokens, s.end_ids)


class _HasSampling(Protocol):
    sampling: SamplingSettings


@contextmanager
def _sampling(engine: _HasSampling, temperature: float) -> Iterator[None]:
    """The engine samples at `temperature` inside the block. Every backend (HF, vLLM) reads its `sampling`
    settings on each call, so the same engine, with the weights weight sync wrote, serves evaluation."""
    saved: SamplingSettings = engine.sampling
    engine.sampling = dataclasses.replace(saved, temperature=temperature)
    try:
        yield
    finally:
        engine.sampling = saved
