"""Actor: the policy being trained."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from rlrun.algo.algorithms import compute_approx_kl
from rlrun.algo.losses import LossAggMode, aggregate_loss
from rlrun.algo.policy_losses import PolicyLossParams, PolicyLossType, policy_loss
from rlrun.algo.rollout_correction import OFF, RolloutCorrection, correct
from rlrun.config.algorithm import AlgorithmConfig
from rlrun.config.distill import DistillConfig
from rlrun.data.batching import TokenBudget, pad_responses, restore_order, trim_padding
from rlrun.data.rollout import RolloutBatch
from rlrun.launch.groups import SequenceParallel
from rlrun.models.lora import adapters_disabled
from rlrun.models.moe import NO_ROUTE, RoutingRun, RoutingShape, routing_shape
from rlrun.roles.forward import LOGITS_CHUNK, fed_tokens, micro_parts, over_micro_batches, policy_log_probs
from rlrun.roles.update import FED_TOKENS, REAL_TOKENS, Updater


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
    params: PolicyLossParams = PolicyLossParams()
    correction: RolloutCorrection = OFF  # engine/actor mismatch correction (needs engine log-probs)
    teacher_kl_coef: float = 0.0  # --teacher_kl_loss: the distillation term's weight
    teacher_kl_estimator: str = "k3"
    teacher_kl_clamp: float | None = None
    aux_loss_coef: float = 0.0  # --aux_loss_coef: the MoE load-balancing loss's weight (rlrun.models.moe)
    # --router_replay: R3 routes the forwards' tokens to the engine's recorded experts, R2 the training passes' to
    # those of the actor's own scoring pass (which records them: Actor.log_probs)
    router_replay: Literal["off", "R2", "R3"] = "off"


def policy_loss_settings(
    a: AlgorithmConfig,
    distill: DistillConfig,
    temperature: float,
    params: PolicyLossParams,
    correction: RolloutCorrection,
) -> PolicyLossSettings:
    """The actor's loss from the algorithm and distillation sections and what rlrun.plan.checks made of them
    (temperature: the sampler's, so that the ratio is taken against the distribution that sampled)."""
    eps_low, eps_high = a.eps_clip_low_high or (a.eps_clip, a.eps_clip)
    # verl's bypass "reinforce": -A log pi times the weights, which is rlrun's gpg loss with them.
    loss_type = "gpg" if correction.bypass and correction.bypass_loss == "reinforce" else a.policy_loss_type
    return PolicyLossSettings(
        eps_low,
        a.dual_clip,
        a.loss_agg_mode,
        temperature,
        a.entropy_loss_coef,
        a.use_kl_loss,
        a.kl_estimator,
        eps_clip_high=eps_high,
        loss_type=loss_type,
        params=params,
        correction=correction,
        teacher_kl_coef=distill.teacher_kl_coef,
        teacher_kl_estimator=distill.teacher_kl_estimator,
        teacher_kl_clamp=distill.teacher_kl_clamp,
        aux_loss_coef=a.aux_loss_coef,
        router_replay=a.router_replay,
    )


@dataclass
class PolicyData:
    """Full-batch training inputs (every actor rank holds all rows). [B, R] unless noted."""

    batch: RolloutBatch
    # None: exactly on-policy, the ratio uses the detached training log-probs; with --rollout_bypass the engine's
    old_log_probs: torch.Tensor | None
    advantages: torch.Tensor
    ref_log_probs: torch.Tensor | None
    weights: torch.Tensor | None = None  # the rollout correction's importance weights (detached)
    teacher_log_probs: torch.Tensor | None = None  # --teacher_kl_loss: the teacher's, for the distillation term


class Actor:
    def __init__(
        self,
        model: nn.Module,
        updater: Updater,
        settings: PolicyLossSettings,
        device: torch.device,
        packing: bool = False,
        logits_chunk: int = LOGITS_CHUNK,
        sp: SequenceParallel | None = None,
    ) -> None:
        self.model = model
        self.sp = sp  # this rank's sequence-parallel group (rlrun.strategies.ulysses)
        self.updater = updater
        self.settings = settings
        self.device = device
        self.packing = packing  # --packing_samples: forward on packed rows (rlrun.data.packing)
        self.logits_chunk = logits_chunk  # --logits_chunk_size: positions per chunk of the vocab projection
        self.routing = routing_shape(model)  # None: a dense policy
        # --router_replay R2: the experts the last log_probs call's tokens went through, [b, L, layers, k] uint8
        self.recorded_routing: torch.Tensor | None = None

    def _moe(self) -> RoutingRun | None:
        """A MoE policy's forward bookkeeping (replaying the batch's recorded routing with --router_replay R2/R3)."""
        return None if self.routing is None else RoutingRun(replay=self.settings.router_replay != "off")

    def _log_probs_of(self, part: RolloutBatch, moe: RoutingRun | None) -> torch.Tensor:
        s = self.settings
        return policy_log_probs(
            self.model, part, s.temperature, packing=self.packing, logits_chunk=self.logits_chunk, sp=self.sp, moe=moe
        )[0]

    def log_probs(self, batch: RolloutBatch, micro_batch: int | TokenBudget) -> torch.Tensor:
        """[b, L] rollouts -> [b, R] log-probs under the current policy (micro_batch: rows, or a token budget). With
        --router_replay R2 (a MoE policy) it also records the experts each token went through: recorded_routing."""
        if self.settings.router_replay != "R2" or self.routing is None:
            return over_micro_batches(
                self.model, batch, micro_batch, self.device, lambda p: self._log_probs_of(p, self._moe())
            )
        return self._recording_log_probs(batch, micro_batch, self.routing)

    @torch.no_grad()
    def _recording_log_probs(
        self, batch: RolloutBatch, micro_batch: int | TokenBudget, shape: RoutingShape
    ) -> torch.Tensor:
        """log_probs, keeping each micro-batch's routing at its rows' columns in recorded_routing (a trimmed part's
        columns are the batch's from P - p on)."""
        self.model.eval()
        B, L = batch.sequences.shape
        P = L - batch.response_width
        recorded = torch.full((B, L, shape.layers, shape.top_k), NO_ROUTE, dtype=torch.uint8)
        parts, outs = [], []
        for rows, part in micro_parts(batch, micro_batch, self.device):
            moe = RoutingRun(replay=False)
            outs.append(pad_responses(self._log_probs_of(part, moe).float().cpu(), batch.response_width))
            parts.append(rows)
            b, width = part.sequences.shape
            p = width - part.response_width
            recorded[rows, P - p : P + part.response_width] = moe.recorded((b, width))
        self.recorded_routing = recorded
        return restore_order(parts, outs)

    def loss(self, data: PolicyData, kl_coef: float, budget: TokenBudget | None, minibatches: int) -> PolicyLoss:
        """The policy loss of one update over `data` in `minibatches` mini-batches, for the actor's Updater (a
        MicroLoss: micro-batch rows -> the loss and its stats). budget: --dynamic_batch micro-batches by tokens, each
        trimmed to its own longest prompt and response."""
        if data.old_log_probs is None and minibatches != 1:
            raise ValueError(f"on-policy training (no old log-probs) needs exactly one mini-batch, got {minibatches}")
        return PolicyLoss(self, data, kl_coef, budget)


class PolicyLoss:
    """One update's policy loss (Actor.loss). Without old log-probs (the on-policy branch) the ratio uses the
    training forward's own detached log-probs, and the loss keeps them per micro-batch: `seen()` gives the trainer
    the log-probs of the policy before the update, in place of the scoring pass it skipped."""

    def __init__(self, actor: Actor, data: PolicyData, kl_coef: float, budget: TokenBudget | None) -> None:
        self.actor, self.data, self.kl_coef, self.budget = actor, data, kl_coef, budget
        self._seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows, [rows, R] detached log-probs)

    def __call__(
        self, rows: torch.Tensor, num_tokens: float, num_seqs: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor | float | int]]:
        actor, data, s = self.actor, self.data, self.actor.settings
        part = data.batch.rows(rows)
        part = (trim_padding(part) if self.budget is not None else part).to(actor.device)
        r = part.response_width  # [b, r] per-token tensors below: the full batch's columns cut to the part's

        def cols(t: torch.Tensor) -> torch.Tensor:
            return t[rows, :r].to(actor.device)

        moe = actor._moe()
        logp, entropy = policy_log_probs(
            actor.model,
            part,
            s.temperature,
            with_entropy=s.entropy_coef is not None,
            packing=actor.packing,
            logits_chunk=actor.logits_chunk,
            sp=actor.sp,
            moe=moe,
        )
        if data.old_log_probs is None:  # on-policy: ratio 1 in value, gradient d(logp) exactly (as TRL)
            old_log_probs = logp.detach()
            self._seen.append((rows, pad_responses(old_log_probs.float().cpu(), data.batch.response_width)))
        else:
            old_log_probs = cols(data.old_log_probs)
        m = part.action_mask
        norm = {"num_tokens": num_tokens, "num_seqs": num_seqs}
        weights = None if data.weights is None else cols(data.weights)
        policy_mask, corrected = m, {}
        c = s.correction
        if c.bypass and part.engine_log_probs is not None:
            # verl's bypass mode: weights and rejections of the current policy against the engine, per micro-batch;
            # rejected tokens leave the policy term only.
            fix = correct(logp.detach(), part.engine_log_probs, m, c)
            policy_mask, corrected = m * fix.keep.to(m.dtype), fix.metrics
            weights = fix.weights if c.bypass_loss == "reinforce" else None
        loss, stats = policy_loss(
            logp,
            old_log_probs,
            cols(data.advantages),
            policy_mask,
            eps_clip=s.eps_clip,
            eps_clip_high=s.eps_clip_high,
            dual_clip=s.dual_clip,
            loss_type=s.loss_type,
            agg=s.agg,
            **norm,
            weights=weights,
            params=s.params,
        )
        reported: dict[str, torch.Tensor | float | int] = {
            "policy_loss": loss.detach(),
            **stats,
            **corrected,
            FED_TOKENS: fed_tokens(actor.model, part, actor.packing, actor.sp.size if actor.sp else 1),
            REAL_TOKENS: int(part.attention_mask.sum()),
        }
        if s.use_kl_loss and data.ref_log_probs is not None:
            kl = compute_approx_kl(logp, cols(data.ref_log_probs), s.kl_estimator, m)  # type: ignore[arg-type]
            kl_loss = aggregate_loss(kl, m, s.agg, **norm)
            loss = loss + self.kl_coef * kl_loss
            reported["kl_loss"] = kl_loss.detach()
        if data.teacher_log_probs is not None:  # verl's GKD-style distillation: D(pi || teacher) backpropagated
            divergence = compute_approx_kl(logp, cols(data.teacher_log_probs), s.teacher_kl_estimator, m)  # type: ignore[arg-type]
            if s.teacher_kl_clamp is not None:
                divergence = divergence.clamp(-s.teacher_kl_clamp, s.teacher_kl_clamp)
            distill_loss = aggregate_loss(divergence, m, s.agg, **norm)
            loss = loss + s.teacher_kl_coef * distill_loss
            reported["distill_loss"] = distill_loss.detach()
        if moe is not None and actor.routing is not None:
            aux, numbers = moe.metrics(actor.routing.top_k)
            reported.update(numbers)
            if s.aux_loss_coef > 0:  # this micro-batch's share of the mini-batch's tokens, as its policy loss
                loss = loss + s.aux_loss_coef * aux * (m.sum() / num_tokens)
        if entropy is not None:
            ent = aggregate_loss(entropy, m, s.agg, **norm)
            loss = loss - s.entropy_coef * ent  # type: ignore[operator]
            reported["entropy"] = ent.detach()
        return loss, reported

    def seen(self) -> torch.Tensor:
        """[b, 1 + R] float: for each row this rank trained on in the on-policy update, its global row index, then
        its log-probs under the policy before the update (what the skipped scoring pass gives)."""
        rows = torch.cat([r for r, _ in self._seen])
        logp = torch.cat([lp for _, lp in self._seen])
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
        sp: SequenceParallel | None = None,
        replay: bool = False,
    ) -> None:
        # The actor's model (adapters_off) keeps the mode the actor's update sets; a frozen copy is always in eval.
        self.model = model if adapters_off else model.eval()
        self.adapters_off = adapters_off
        self.sp = sp  # this rank's sequence-parallel group (rlrun.strategies.ulysses)
        self.packing = packing  # --packing_samples: forward on packed rows (rlrun.data.packing)
        self.logits_chunk = logits_chunk  # --logits_chunk_size: positions per chunk of the vocab projection
        self.temperature = temperature
        self.device = device
        self.replay = replay  # --router_replay R3 on a MoE policy: route tokens to the engine's recorded experts

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
                self.model,
                p,
                self.temperature,
                packing=self.packing,
                logits_chunk=self.logits_chunk,
                sp=self.sp,
                moe=RoutingRun(replay=True) if self.replay else None,
            )[0],
        )
