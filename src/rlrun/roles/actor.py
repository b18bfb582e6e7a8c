"""Actor: the policy being trained."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from rlrun.algo.algorithms import compute_approx_kl
from rlrun.algo.losses import ISCorrection, LossAggMode, PolicyLossType, aggregate_loss, policy_loss
from rlrun.data.batching import TokenBudget, pad_responses, trim_padding
from rlrun.data.rollout import RolloutBatch
from rlrun.models.lora import adapters_disabled
from rlrun.roles.forward import LOGITS_CHUNK, fed_tokens, over_micro_batches, policy_log_probs
from rlrun.roles.update import FED_TOKENS, REAL_TOKENS, MicroLoss, Updater


@dataclass(frozen=True)
class PolicyLossSettings:
    eps_clip: float
    dual_clip: float | None
    agg: LossAggMode
    temperature: float
    entropy_coef: float | None
    use_kl_loss: bool
    kl_estimator: str
    eps_clip_high: float | None = None  # upper clip range; None: eps_clip (symmetric)
    loss_type: PolicyLossType = "ppo"
    is_correction: ISCorrection | None = None  # engine/actor mismatch correction (needs engine log-probs)


@dataclass
class PolicyData:
    """Full-batch training inputs (every actor rank holds all rows). [B, R] unless noted."""

    batch: RolloutBatch
    old_log_probs: torch.Tensor | None  # None: exactly on-policy, the ratio uses the detached training log-probs
    advantages: torch.Tensor
    ref_log_probs: torch.Tensor | None


class Actor:
    def __init__(
        self,
        model: nn.Module,
        updater: Updater,
        settings: PolicyLossSettings,
        device: torch.device,
        packing: bool = False,
        logits_chunk: int = LOGITS_CHUNK,
    ) -> None:
        self.model = model
        self.updater = updater
        self.settings = settings
        self.device = device
        self.packing = packing  # --packing_samples: forward on packed rows (rlrun.data.packing)
        self.logits_chunk = logits_chunk  # --logits_chunk_size: positions per chunk of the vocab projection
        # (rows, [rows, R] detached log-probs) per micro-batch of the last on-policy update (PolicyData.old_log_probs
        # None): the trainer gathers them in place of the skipped scoring pass.
        self._on_policy: list[tuple[torch.Tensor, torch.Tensor]] = []

    def log_probs(self, batch: RolloutBatch, micro_batch: int | TokenBudget) -> torch.Tensor:
        """[b, L] rollouts -> [b, R] log-probs under the current policy (micro_batch: rows, or a token budget)."""
        temp = self.settings.temperature
        return over_micro_batches(
            self.model,
            batch,
            micro_batch,
            self.device,
            lambda p: policy_log_probs(self.model, p, temp, packing=self.packing, logits_chunk=self.logits_chunk)[0],
        )

    def loss(self, data: PolicyData, kl_coef: float, budget: TokenBudget | None, minibatches: int) -> MicroLoss:
        """The policy loss of one update over `data` in `minibatches` mini-batches, for the actor's Updater:
        micro-batch rows -> (the loss, its stats). budget: --dynamic_batch micro-batches by tokens, each trimmed to
        its own longest prompt and response."""
        s = self.settings
        width = data.batch.response_width
        if data.old_log_probs is None and minibatches != 1:
            raise ValueError(f"on-policy training (no old log-probs) needs exactly one mini-batch, got {minibatches}")
        self._on_policy = []

        def micro_loss(
            rows: torch.Tensor, num_tokens: float, num_seqs: float
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor | int]]:
            part = data.batch.rows(rows)
            part = (trim_padding(part) if budget is not None else part).to(self.device)
            r = part.response_width  # [b, r] per-token tensors below: the full batch's columns cut to the part's

            def cols(t: torch.Tensor) -> torch.Tensor:
                return t[rows, :r].to(self.device)

            logp, entropy = policy_log_probs(
                self.model,
                part,
                s.temperature,
                with_entropy=s.entropy_coef is not None,
                packing=self.packing,
                logits_chunk=self.logits_chunk,
            )
            if data.old_log_probs is None:  # on-policy: ratio 1 in value, gradient d(logp) exactly (as TRL)
                old_log_probs = logp.detach()
                self._on_policy.append((rows, pad_responses(old_log_probs.float().cpu(), width)))
            else:
                old_log_probs = cols(data.old_log_probs)
            m = part.action_mask
            norm = {"num_tokens": num_tokens, "num_seqs": num_seqs}
            loss, stats = policy_loss(
                logp,
                old_log_probs,
                cols(data.advantages),
                m,
                eps_clip=s.eps_clip,
                eps_clip_high=s.eps_clip_high,
                dual_clip=s.dual_clip,
                loss_type=s.loss_type,
                agg=s.agg,
                **norm,
                rollout_log_probs=part.engine_log_probs,
                is_correction=s.is_correction,
            )
            reported: dict[str, torch.Tensor | int] = {
                "policy_loss": loss.detach(),
                **stats,
                FED_TOKENS: fed_tokens(self.model, part, self.packing),
                REAL_TOKENS: int(part.attention_mask.sum()),
            }
            if s.use_kl_loss and data.ref_log_probs is not None:
                kl = compute_approx_kl(logp, cols(data.ref_log_probs), s.kl_estimator, m)  # type: ignore[arg-type]
                kl_loss = aggregate_loss(kl, m, s.agg, **norm)
                loss = loss + kl_coef * kl_loss
                reported["kl_loss"] = kl_loss.detach()
            if entropy is not None:
                ent = aggregate_loss(entropy, m, s.agg, **norm)
                loss = loss - s.entropy_coef * ent  # type: ignore[operator]
                reported["entropy"] = ent.detach()
            return loss, reported

        return micro_loss

    def on_policy_log_probs(self) -> torch.Tensor:
        """[b, 1 + R] float: for each row this rank trained on in the last on-policy update, its global row
        index, then its log-probs under the policy before the update (what the skipped scoring pass gives)."""
        rows = torch.cat([r for r, _ in self._on_policy])
        logp = torch.cat([lp for _, lp in self._on_policy])
        return torch.cat([rows.float().unsqueeze(1), logp], dim=1)


# ---- the reference -----------------------------------------------------------------------------------------------
# Reference: a frozen copy of the initial policy, or (LoRA) the actor's own model with its adapters disabled.


class Reference:
    def __init__(
        self,
        model: nn.Module,
        temperature: float,
        device: torch.device,
        packing: bool = False,
        logits_chunk: int = LOGITS_CHUNK,
        adapters_off: bool = False,
    ) -> None:
        # The actor's model (adapters_off) keeps the mode the actor's update sets; a frozen copy is always in eval.
        self.model = model if adapters_off else model.eval()
        self.adapters_off = adapters_off
        self.packing = packing  # --packing_samples: forward on packed rows (rlrun.data.packing)
        self.logits_chunk = logits_chunk  # --logits_chunk_size: positions per chunk of the vocab projection
        self.temperature = temperature
        self.device = device

    def log_probs(self, batch: RolloutBatch, micro_batch: int | TokenBudget) -> torch.Tensor:
        """[b, L] rollouts -> [b, R] reference log-probs (micro_batch: rows, or a token budget)."""
        with adapters_disabled(self.model) if self.adapters_off else nullcontext():
            return self._log_probs(batch, micro_batch)

    def _log_probs(self, batch: RolloutBatch, micro_batch: int | TokenBudget) -> torch.Tensor:
        return over_micro_batches(
            self.model,
            batch,
            micro_batch,
            self.device,
            lambda p: policy_log_probs(
                self.model, p, self.temperature, packing=self.packing, logits_chunk=self.logits_chunk
            )[0],
        )
