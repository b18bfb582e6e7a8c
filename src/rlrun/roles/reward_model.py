"""Reward role backed by a reward model (a scalar head scoring the last token)."""

from __future__ import annotations

import torch
from torch import nn

from rlrun.roles.forward import last_token_scores, over_micro_batches
from rlrun.rollout import RolloutBatch


class RewardModel:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model.eval()
        self.device = device

    def score(self, batch: RolloutBatch, micro_batch: int) -> torch.Tensor:
        """[b, L] rollouts -> [b] scores."""
        R = batch.response_width
        return over_micro_batches(self.model, batch, micro_batch, self.device,
                                  lambda p: last_token_scores(self.model, p.sequences, p.attention_mask, p.response_len, R))
