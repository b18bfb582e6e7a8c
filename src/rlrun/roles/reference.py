"""Reference: a frozen copy of the initial policy."""

from __future__ import annotations

import torch
from torch import nn

from rlrun.data.rollout import RolloutBatch
from rlrun.roles.forward import LOGITS_CHUNK, over_micro_batches, policy_log_probs


class Reference:
    def __init__(self, model: nn.Module, temperature: float, device: torch.device, packing: bool = False,
                 logits_chunk: int = LOGITS_CHUNK) -> None:
        self.model = model.eval()
        self.packing = packing  # --packing_samples: forward on packed rows (rlrun.data.packing)
        self.logits_chunk = logits_chunk  # --logits_chunk_size: positions per chunk of the vocab projection
        self.temperature = temperature
        self.device = device

    def log_probs(self, batch: RolloutBatch, micro_batch: int) -> torch.Tensor:
        """[b, L] rollouts -> [b, R] reference log-probs."""
        return over_micro_batches(self.model, batch, micro_batch, self.device,
                                  lambda p: policy_log_probs(self.model, p, self.temperature, packing=self.packing,
                                                             logits_chunk=self.logits_chunk)[0])
