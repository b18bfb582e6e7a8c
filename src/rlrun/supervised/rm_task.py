"""Reward model: a scalar head read at each sequence's last token, trained on preference pairs
(chosen above rejected); saved as a sequence-classification model `rlrun.ppo --reward_pretrain` loads,
with the reward mean/std OpenRLHF's --normalize_reward reads from its config."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import PreTrainedTokenizerBase

from rlrun.models.loading import ScalarHeadModel
from rlrun.roles.export import save_scalar_model
from rlrun.roles.forward import sequence_scores
from rlrun.strategies.base import Strategy
from rlrun.supervised.batches import sequences_batch
from rlrun.supervised.datasets import Preference
from rlrun.supervised.losses import pairwise_rm_loss
from rlrun.supervised.task import Tally


@dataclass
class RewardModelTask:
    model: ScalarHeadModel  # wrapped by the strategy
    optimizer: torch.optim.Optimizer
    strategy: Strategy
    device: torch.device
    pad_id: int
    packing: bool
    loss_kind: Literal["sigmoid", "logexpsigmoid"]
    margin_loss: bool
    name: str = "rm"
    tally_keys: tuple[str, ...] = ("loss", "correct", "chosen", "rejected", "pairs", "reward_sq")
    tally: Tally = field(default_factory=Tally)
    # (mean, std) of the rewards of the last evaluation, chosen and rejected sequences alike: saved in config.json
    reward_stats: tuple[float, float] | None = None

    def loss_tokens(self, sample: Preference) -> int:
        return 1  # the loss is a mean over pairs

    def _scores(self, samples: list[Preference]) -> tuple[torch.Tensor, torch.Tensor]:
        """[b] chosen and [b] rejected rewards: one forward over 2b rows (chosen rows first)."""
        batch = sequences_batch([s.prompt for s in samples] * 2, [s.chosen for s in samples] + [s.rejected for s in samples],
                                self.pad_id).to(self.device)
        scores = sequence_scores(self.model, batch, packing=self.packing)
        return scores[:len(samples)], scores[len(samples):]

    def _record(self, chosen: torch.Tensor, rejected: torch.Tensor, losses: torch.Tensor) -> None:
        chosen, rejected = chosen.detach().float(), rejected.detach().float()
        self.tally.add(loss=losses.detach().sum(), correct=(chosen > rejected).sum(), chosen=chosen.sum(),
                       rejected=rejected.sum(), pairs=len(chosen), reward_sq=(chosen**2).sum() + (rejected**2).sum())

    def _losses(self, samples: list[Preference]) -> torch.Tensor:
        """[b] per-pair losses (and their metrics recorded)."""
        chosen, rejected = self._scores(samples)
        margin = torch.tensor([s.margin for s in samples], device=chosen.device) if self.margin_loss else None
        losses = pairwise_rm_loss(chosen, rejected, kind=self.loss_kind, margin=margin)
        self._record(chosen, rejected, losses)
        return losses

    def micro_loss(self, samples: list[Preference], num_tokens: float, num_seqs: float) -> torch.Tensor:
        return self._losses(samples).sum() / num_seqs

    def score(self, samples: list[Preference]) -> None:
        self._losses(samples)

    def summary(self, sums: dict[str, float], *, evaluation: bool) -> dict[str, float]:
        pairs = max(sums["pairs"], 1.0)
        out = {"loss": sums["loss"] / pairs, "acc": sums["correct"] / pairs, "chosen_reward": sums["chosen"] / pairs,
               "reject_reward": sums["rejected"] / pairs, "margin": (sums["chosen"] - sums["rejected"]) / pairs}
        if evaluation:  # OpenRLHF's: over chosen and rejected rewards together, unbiased std, at least 1e-8
            n = 2 * pairs
            mean = (sums["chosen"] + sums["rejected"]) / n
            std = max(math.sqrt(max(sums["reward_sq"] - n * mean**2, 0.0) / max(n - 1, 1.0)), 1e-8)
            self.reward_stats = (mean, std)
            out.update(reward_mean=mean, reward_std=std)
        return out

    def save(self, path: str, tokenizer: PreTrainedTokenizerBase, *, is_writer: bool, allow_nonfinite: bool = False,
             merged: bool = False) -> None:
        config = self.model.hf.config
        if self.reward_stats is not None:
            config.mean, config.std = self.reward_stats
        save_scalar_model(self.model, path, is_writer=is_writer, strategy=self.strategy, flag="--save_path",
                          tokenizer=tokenizer, allow_nonfinite=allow_nonfinite, merged=merged)
