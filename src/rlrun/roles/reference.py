"""Reference: a frozen copy of the initial policy."""

from __future__ import annotations

import torch
from torch import nn

from rlrun.roles.forward import micro_batches, response_log_probs
from rlrun.rollout import RolloutBatch


class Reference:
    def __init__(self, model: nn.Module, temperature: float, device: torch.device) -> None:
        self.model = model.eval()
        self.temperature = temperature
        self.device = device

    @torch.no_grad()
    def log_probs(self, batch: RolloutBatch, micro_batch: int) -> torch.Tensor:
        """[b, L] rollouts -> [b, R] reference log-probs."""
        out = []
        for rows in micro_batches(batch.sequences.shape[0], micro_batch):
            part = batch.rows(rows).to(self.device)
            logp, _ = response_log_probs(self.model, part.sequences, part.attention_mask, batch.response_width, self.temperature)
            out.append(logp.cpu())
        return torch.cat(out)
