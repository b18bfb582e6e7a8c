"""Reference: a frozen copy of the initial policy."""

from __future__ import annotations

import torch
from torch import nn

from rlrun.roles.forward import over_micro_batches, response_log_probs
from rlrun.rollout import RolloutBatch


class Reference:
    def __init__(self, model: nn.Module, temperature: float, device: torch.device) -> None:
        self.model = model.eval()
        self.temperature = temperature
        self.device = device

    def log_probs(self, batch: RolloutBatch, micro_batch: int) -> torch.Tensor:
        """[b, L] rollouts -> [b, R] reference log-probs."""
        R, temp = batch.response_width, self.temperature
        return over_micro_batches(self.model, batch, micro_batch, self.device,
                                  lambda p: response_log_probs(self.model, p.sequences, p.attention_mask, R, temp)[0])
