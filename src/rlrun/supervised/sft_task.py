"""SFT: next-token NLL on the response tokens (the prompt is context only), a token mean over the global batch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from rlrun.roles.export import save_causal_lm
from rlrun.roles.forward import policy_log_probs
from rlrun.strategies.base import Strategy
from rlrun.supervised.batches import sequences_batch
from rlrun.supervised.datasets import Completion
from rlrun.supervised.losses import token_nll
from rlrun.supervised.task import Tally


@dataclass
class SFTTask:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    strategy: Strategy
    device: torch.device
    pad_id: int
    packing: bool
    name: str = "sft"
    tally_keys: tuple[str, ...] = ("nll", "tokens")
    tally: Tally = field(default_factory=Tally)

    def loss_tokens(self, sample: Completion) -> int:
        # sequences_batch moves the first token of a prompt-less sample into the prompt
        return max(1, len(sample.response) - (0 if sample.prompt else 1))

    def _nll(self, samples: list[Completion]) -> tuple[torch.Tensor, torch.Tensor]:
        """[b] summed NLL of each response, [b, r] response mask."""
        batch = sequences_batch([s.prompt for s in samples], [s.response for s in samples], self.pad_id).to(self.device)
        log_probs, _ = policy_log_probs(self.model, batch, 1.0, packing=self.packing)
        return token_nll(log_probs, batch.action_mask), batch.action_mask

    def micro_loss(self, samples: list[Completion], num_tokens: float, num_seqs: float) -> torch.Tensor:
        nll, mask = self._nll(samples)
        self.tally.add(nll=nll.detach().sum(), tokens=mask.sum())
        return nll.sum() / num_tokens

    def score(self, samples: list[Completion]) -> None:
        nll, mask = self._nll(samples)
        self.tally.add(nll=nll.sum(), tokens=mask.sum())

    def summary(self, sums: dict[str, float], *, evaluation: bool) -> dict[str, float]:
        loss = sums["nll"] / max(sums["tokens"], 1.0)
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": sums["tokens"]}

    def save(self, path: str, tokenizer: PreTrainedTokenizerBase, *, is_writer: bool, allow_nonfinite: bool = False,
             merged: bool = False) -> None:
        save_causal_lm(self.model, tokenizer, path, is_writer=is_writer, strategy=self.strategy,
                       allow_nonfinite=allow_nonfinite, merged=merged)
