"""Reward role backed by a reward model (a scalar head scoring the last token)."""

from __future__ import annotations

import torch
from torch import nn

from rlrun.data.rollout import RolloutBatch
from rlrun.roles.forward import over_micro_batches, sequence_scores


class RewardModel:
    def __init__(self, model: nn.Module, device: torch.device, packing: bool = False) -> None:
        self.model = model.eval()
        self.packing = packing  # --packing_samples: forward on packed rows (rlrun.data.packing)
        self.device = device

    def score(self, batch: RolloutBatch, micro_batch: int) -> torch.Tensor:
        """[b, L] rollouts -> [b] scores."""
        return over_micro_batches(self.model, batch, micro_batch, self.device,
                                  lambda p: sequence_scores(self.model, p, packing=self.packing))
