"""Reward role backed by a reward model (a scalar head scoring the last token)."""

from __future__ import annotations

import torch
from torch import nn

from rlrun.roles.forward import last_token_scores, micro_batches
from rlrun.rollout import RolloutBatch


class RewardModel:
    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model.eval()
        self.device = device

    @torch.no_grad()
    def score(self, batch: RolloutBatch, micro_batch: int) -> torch.Tensor:
        """[b, L] rollouts -> [b] scores."""
        out = []
        for rows in micro_batches(batch.sequences.shape[0], micro_batch):
            part = batch.rows(rows).to(self.device)
            out.append(last_token_scores(self.model, part.sequences, part.attention_mask, part.response_len,
                                         batch.response_width).float().cpu())
        return torch.cat(out)
