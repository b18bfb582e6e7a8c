"""Actor: the policy being trained."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlrun.algorithms import LossAggMode, aggregate_loss, compute_approx_kl, policy_loss
from rlrun.roles.forward import over_micro_batches, response_log_probs
from rlrun.roles.update import Updater
from rlrun.rollout import RolloutBatch


@dataclass(frozen=True)
class PolicyLossSettings:
    eps_clip: float
    dual_clip: float | None
    agg: LossAggMode
    temperature: float
    entropy_coef: float | None
    use_kl_loss: bool
    kl_estimator: str


@dataclass
class PolicyData:
    """Full-batch training inputs (every actor rank holds all rows). [B, R] unless noted."""

    batch: RolloutBatch
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    ref_log_probs: torch.Tensor | None


class Actor:
    def __init__(self, model: nn.Module, updater: Updater, settings: PolicyLossSettings, device: torch.device) -> None:
        self.model = model
        self.updater = updater
        self.settings = settings
        self.device = device

    def log_probs(self, batch: RolloutBatch, micro_batch: int) -> torch.Tensor:
        """[b, L] rollouts -> [b, R] log-probs under the current policy."""
        R, temp = batch.response_width, self.settings.temperature
        return over_micro_batches(self.model, batch, micro_batch, self.device,
                                  lambda p: response_log_probs(self.model, p.sequences, p.attention_mask, R, temp)[0])

    def train(self, data: PolicyData, minibatches: list[torch.Tensor], kl_coef: float) -> dict[str, float]:
        s = self.settings
        mask = data.batch.action_mask

        def micro_loss(rows: torch.Tensor, num_tokens: float, num_seqs: float):
            part = data.batch.rows(rows).to(self.device)
            logp, entropy = response_log_probs(self.model, part.sequences, part.attention_mask,
                                               data.batch.response_width, s.temperature,
                                               with_entropy=s.entropy_coef is not None)
            m = part.action_mask
            norm = {"num_tokens": num_tokens, "num_seqs": num_seqs}
            loss, stats = policy_loss(logp, data.old_log_probs[rows].to(self.device), data.advantages[rows].to(self.device),
                                      m, eps_clip=s.eps_clip, dual_clip=s.dual_clip, agg=s.agg, **norm)
            stats = {"policy_loss": loss.detach(), **stats}
            if s.use_kl_loss and data.ref_log_probs is not None:
                kl = compute_approx_kl(logp, data.ref_log_probs[rows].to(self.device), s.kl_estimator, m)  # type: ignore[arg-type]
                kl_loss = aggregate_loss(kl, m, s.agg, **norm)
                loss = loss + kl_coef * kl_loss
                stats["kl_loss"] = kl_loss.detach()
            if entropy is not None:
                ent = aggregate_loss(entropy, m, s.agg, **norm)
                loss = loss - s.entropy_coef * ent  # type: ignore[operator]
                stats["entropy"] = ent.detach()
            return loss, stats

        stats = self.updater.run(minibatches, mask, micro_loss)
        return {f"actor/{k}": v for k, v in stats.items()}
