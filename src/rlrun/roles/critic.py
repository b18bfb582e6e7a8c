"""Critic: per-token value estimates and their regression update."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlrun.algo.losses import LossAggMode, value_loss
from rlrun.data.rollout import RolloutBatch
from rlrun.roles.forward import over_micro_batches, token_values
from rlrun.roles.update import Updater


@dataclass
class ValueData:
    """Full-batch inputs, [B, R]."""

    batch: RolloutBatch
    old_values: torch.Tensor
    returns: torch.Tensor


class Critic:
    def __init__(self, model: nn.Module, updater: Updater, value_clip: float | None, agg: LossAggMode,
                 device: torch.device, packing: bool = False) -> None:
        self.model = model
        self.packing = packing  # --packing_samples: forward on packed rows (rlrun.data.packing)
        self.updater = updater
        self.value_clip = value_clip
        self.agg = agg
        self.device = device

    def values(self, batch: RolloutBatch, micro_batch: int) -> torch.Tensor:
        """[b, L] rollouts -> [b, R] values."""
        return over_micro_batches(self.model, batch, micro_batch, self.device,
                                  lambda p: token_values(self.model, p, packing=self.packing))

    def train(self, data: ValueData, minibatches: list[torch.Tensor]) -> dict[str, float]:
        def micro_loss(rows: torch.Tensor, num_tokens: float, num_seqs: float):
            part = data.batch.rows(rows).to(self.device)
            values = token_values(self.model, part, packing=self.packing)
            loss, stats = value_loss(values, data.old_values[rows].to(self.device), data.returns[rows].to(self.device),
                                     part.action_mask, value_clip=self.value_clip, agg=self.agg,
                                     num_tokens=num_tokens, num_seqs=num_seqs)
            return loss, {"value_loss": loss.detach(), **stats}

        stats = self.updater.run(minibatches, data.batch.action_mask, micro_loss)
        return {f"critic/{k}": v for k, v in stats.items()}
