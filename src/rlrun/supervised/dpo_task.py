"""DPO (and IPO, cDPO): the policy's log-ratio to a frozen reference on chosen vs rejected responses."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from rlrun.data.rollout import RolloutBatch
from rlrun.models.lora import adapters_disabled
from rlrun.roles.export import save_causal_lm
from rlrun.roles.forward import policy_log_probs
from rlrun.strategies.base import Strategy
from rlrun.supervised.batches import sequences_batch
from rlrun.supervised.datasets import Preference
from rlrun.supervised.losses import dpo_loss, nll_term, sequence_log_prob
from rlrun.supervised.task import Tally


@dataclass(frozen=True)
class DPOSettings:
    beta: float
    label_smoothing: float
    ipo: bool
    nll_loss_coef: float


@dataclass
class DPOTask:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    strategy: Strategy
    # frozen, wrapped by its own strategy; None with LoRA: the policy with its adapters disabled (its base)
    reference: nn.Module | None
    device: torch.device
    pad_id: int
    packing: bool
    settings: DPOSettings
    name: str = "dpo"
    tally_keys: tuple[str, ...] = ("loss", "correct", "chosen_reward", "rejected_reward", "pairs", "nll")
    tally: Tally = field(default_factory=Tally)

    def loss_tokens(self, sample: Preference) -> int:
        return 1  # both terms are means over pairs

    def _batch(self, samples: list[Preference]) -> RolloutBatch:
        return sequences_batch([s.prompt for s in samples] * 2, [s.chosen for s in samples] + [s.rejected for s in samples],
                               self.pad_id).to(self.device)

    def _sequence_log_probs(self, model: nn.Module, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """[2b] summed response log-probs and [2b, r] per-token log-probs (chosen rows first)."""
        log_probs, _ = policy_log_probs(model, batch, 1.0, packing=self.packing)
        return sequence_log_prob(log_probs, batch.action_mask), log_probs

    def _terms(self, samples: list[Preference]) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-pair DPO losses [b], per-token mean NLL of each chosen response [b])."""
        b = len(samples)
        batch = self._batch(samples)
        # The reference first: with LoRA it is the policy's own (sharded) model, and this order keeps the policy's
        # forward the last one before its backward, as in a run with a separate reference.
        with torch.no_grad(), self._reference() as reference_model:
            reference, _ = self._sequence_log_probs(reference_model, batch)
        policy, token_log_probs = self._sequence_log_probs(self.model, batch)
        s = self.settings
        terms = dpo_loss(policy[:b], policy[b:], reference[:b], reference[b:], beta=s.beta,
                         label_smoothing=s.label_smoothing, ipo=s.ipo)
        nll = nll_term(token_log_probs[:b], batch.action_mask[:b])
        self.tally.add(loss=terms.losses.detach().sum(), correct=(terms.chosen_rewards > terms.rejected_rewards).sum(),
                       chosen_reward=terms.chosen_rewards.sum(), rejected_reward=terms.rejected_rewards.sum(), pairs=b,
                       nll=nll.detach().sum())
        return terms.losses, nll

    @contextmanager
    def _reference(self) -> Iterator[nn.Module]:
        """The reference model, in eval mode while open (no dropout: a frozen model's log-probs)."""
        if self.reference is not None:
            yield self.reference.eval()
            return
        training = self.model.training
        self.model.eval()
        try:
            with adapters_disabled(self.model):
                yield self.model
        finally:
            self.model.train(training)

    def micro_loss(self, samples: list[Preference], num_tokens: float, num_seqs: float) -> torch.Tensor:
        losses, nll = self._terms(samples)
        if self.settings.nll_loss_coef > 0:  # OpenRLHF's Llama-3.1 regulariser: a mean over pairs, like the DPO loss
            losses = losses + self.settings.nll_loss_coef * nll
        return losses.sum() / num_seqs

    def score(self, samples: list[Preference]) -> None:
        self._terms(samples)

    def summary(self, sums: dict[str, float], *, evaluation: bool) -> dict[str, float]:
        pairs = max(sums["pairs"], 1.0)
        chosen, rejected = sums["chosen_reward"] / pairs, sums["rejected_reward"] / pairs
        return {"loss": sums["loss"] / pairs, "acc": sums["correct"] / pairs, "chosen_reward": chosen,
                "reject_reward": rejected, "margin": chosen - rejected,
                "nll_loss": sums["nll"] / pairs}

    def save(self, path: str, tokenizer: PreTrainedTokenizerBase, *, is_writer: bool, allow_nonfinite: bool = False,
             merged: bool = False) -> None:
        save_causal_lm(self.model, tokenizer, path, is_writer=is_writer, strategy=self.strategy,
                       allow_nonfinite=allow_nonfinite, merged=merged)
