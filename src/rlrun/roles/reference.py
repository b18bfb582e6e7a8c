"""Reference: a frozen copy of the initial policy, or (LoRA) the actor's own model with its adapters disabled."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from rlrun.data.rollout import RolloutBatch
from rlrun.models.lora import adapters_disabled
from rlrun.roles.forward import LOGITS_CHUNK, over_micro_batches, policy_log_probs


class Reference:
    def __init__(self, model: nn.Module, temperature: float, device: torch.device, packing: bool = False,
                 logits_chunk: int = LOGITS_CHUNK, adapters_off: bool = False) -> None:
        # The actor's model (adapters_off) keeps the mode the actor's update sets; a frozen copy is always in eval.
        self.model = model if adapters_off else model.eval()
        self.adapters_off = adapters_off
        self.packing = packing  # --packing_samples: forward on packed rows (rlrun.data.packing)
        self.logits_chunk = logits_chunk  # --logits_chunk_size: positions per chunk of the vocab projection
        self.temperature = temperature
        self.device = device

    def log_probs(self, batch: RolloutBatch, micro_batch: int) -> torch.Tensor:
        """[b, L] rollouts -> [b, R] reference log-probs."""
        with adapters_disabled(self.model) if self.adapters_off else nullcontext():
            return self._log_probs(batch, micro_batch)

    def _log_probs(self, batch: RolloutBatch, micro_batch: int) -> torch.Tensor:
        return over_micro_batches(self.model, batch, micro_batch, self.device,
                                  lambda p: policy_log_probs(self.model, p, self.temperature, packing=self.packing,
                                                             logits_chunk=self.logits_chunk)[0])
