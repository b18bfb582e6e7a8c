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
from typing import Protocol

import torch

from rlrun.algo.algorithms import cut_by_length
from rlrun.config.evaluation import EvalConfig
from rlrun.config.generation import GenerationConfig
from rlrun.config.tracking import TrackingConfig
from rlrun.config.training import TrainConfig
from rlrun.data.batching import derive_seed
from rlrun.data.prompts import Prompts
from rlrun.engines.protocol import Engine, SamplingSettings
from rlrun.launch.context import RankContext
from rlrun.launch.layout import Role
from rlrun.launch.transfer import all_gather_vectors
from rlrun.rl.sampling import Rewarding, sample_and_reward

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
        ctx: RankContext,
        ev: EvalConfig,
        tracking: TrackingConfig,
        train: TrainConfig,
        generation: GenerationConfig,
        prompts: Prompts,
        engine: Engine | None,
        rewarding: Rewarding,
    ) -> None:
        """`engine`: an engine rank's (None elsewhere); `rewarding`: how its samples get their rewards (as the
        rollouts': a reward function or agents, never a reward model)."""
        self.groups, self.prompts, self.tokenizer = ctx.groups, prompts, ctx.tokenizer
        self.seed, self.prompt_max_len = ctx.seed, generation.prompt_max_len
        self.comm_device = ctx.device
        layout = ctx.layout
        self.every, self.before_train, self.n = (
            tracking.eval_steps,
            tracking.eval_before_train,
            ev.eval_n_samples_per_prompt,
        )
        self.engine_ranks = layout.ranks_of(Role.ENGINE)
        self.engine, self.rewarding = engine, rewarding
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
            r, n, cut = self._chunk(part, seed)
            rewards.append(r)
            lengths.append(n)
            truncated.append(cut)
        if not rows:
            return local_totals(torch.zeros(0, self.n), torch.zeros(0, self.n), torch.zeros(0, self.n))
        shape = (len(indices), self.n)
        return local_totals(
            torch.cat(rewards).view(shape), torch.cat(lengths).view(shape), torch.cat(truncated).view(shape)
        )

    def _chunk(self, rows: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rewards [b], response lengths [b], truncated [b]) of one generate call, or of one batch of agent
        episodes (length = actions and observations; truncated = ended by the token budget)."""
        assert self.engine is not None
        ids, vision = [self.prompts.ids[i] for i in rows], None
        if self.prompts.images is not None and self.rewarding.agents is None:  # a vision-language policy's images
            ids, vision = self.prompts.with_images(rows, self.prompt_max_len)
        sampled = sample_and_reward(self.engine, self.rewarding, self.prompts, rows, ids, seed, self.tokenizer, vision)
        assert sampled.rewards is not None  # a reward function or agents (planning refuses a reward model)
        length = torch.tensor([len(r) for r in sampled.responses])
        if sampled.truncated is not None:  # episodes: ended by the token budget
            return sampled.rewards.float(), length, torch.tensor(sampled.truncated)
        last = torch.tensor([r[-1] if r else -1 for r in sampled.responses])
        s = self.engine.sampling
        return sampled.rewards.float(), length, cut_by_length(last, length, s.max_new_tokens, s.end_ids)


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
