"""Pure tensor maths for PPO / GRPO / RLOO / REINFORCE++.

Everything here is a stateless function of tensors (the KL controllers hold one
float). Nothing here runs a collective: anything that must be global (advantage
whitening across ranks, token counts for loss aggregation) is the caller's job, and
the functions take the global numbers as arguments where that matters.

Shape conventions: ``B`` rows (sequences), ``T`` response positions, ``V`` vocab.
Masks are 0/1 (any dtype) with 1 on response tokens; responses are right-padded,
but GAE/returns also tolerate holes in the mask (masked positions are skipped).
Semantics follow OpenRLHF (models/utils.py, models/loss.py, experience_maker.py)
and verl core_algos.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from rlrun.is_correction import ISCorrection, correction_weights

KLEstimator = Literal["k1", "k2", "k3"]
PolicyLossType = Literal["ppo", "gspo"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
AdvantageEstimator = Literal["gae", "group_norm", "dr_grpo", "rloo", "reinforce",
                             "reinforce_baseline"]

KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
POLICY_LOSS_TYPES: tuple[str, ...] = get_args(PolicyLossType)
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
# Estimators whose baseline comes from the reward signal itself, so no critic is trained.
GROUP_ESTIMATORS: frozenset[str] = frozenset(ADVANTAGE_ESTIMATORS) - {"gae"}
# Estimators that subtract a per-prompt group statistic and so need n_samples_per_prompt > 1.
_NEEDS_GROUP: frozenset[str] = frozenset({"group_norm", "dr_grpo", "rloo", "reinforce_baseline"})
# Estimators whose advantages get REINFORCE++-style global whitening.
_WHITENED: frozenset[str] = frozenset({"gae", "reinforce", "reinforce_baseline"})
# Estimators OpenRLHF runs with gamma = 1 whatever --gamma says (experience_maker.py,
# compute_advantages_and_returns): the group baseline is a sequence-level quantity, and
# discounting the terminal score per token would make it depend on the response length.
GAMMA_ONE_ESTIMATORS: frozenset[str] = _NEEDS_GROUP

# OpenRLHF bounds every KL estimate to [-KL_CLAMP, KL_CLAMP] and k3's log-ratio from below at
# -KL_CLAMP (models/utils.py, compute_approx_kl): a policy far from the reference gets a
# bounded penalty, and no gradient, instead of an exploding one.
KL_CLAMP = 10.0

# Bound on log-ratios fed to exp(): keeps exp() finite in fp32 so A=0 tokens cannot
# produce 0*inf = NaN (verl uses the same bound); beyond it the sample is garbage anyway.
_MAX_LOG_RATIO = 20.0


def _as_float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.to(torch.float32)


def _check_choice(name: str, value: str, allowed: tuple[str, ...] | frozenset[str]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {sorted(allowed)}")


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over entries where ``mask`` is nonzero.

    x, mask: same shape, e.g. [B, T]. Returns a scalar (dim=None) or x reduced over dim.
    An all-masked reduction returns 0 instead of NaN so empty micro-batches are harmless.
    """
    m = mask.bool().expand_as(x)
    # where() rather than x*mask: a NaN/inf at a padded position must not leak into the sum.
    xs = torch.where(m, x, 0.0)
    if dim is None:
        return xs.sum() / m.sum().clamp_min(1).to(x.dtype)
    return xs.sum(dim) / m.sum(dim).clamp_min(1).to(x.dtype)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8,
                  divide_std: bool = True) -> Tensor:
    """Normalise ``x`` to zero mean / unit (biased) std over masked entries.

    x, mask: [B, T] -> [B, T]; masked-out positions are 0. With ``shift_mean=False``
    the original mean is added back (only the scale changes), as in verl. With
    ``divide_std=False`` only the mean is subtracted (OpenRLHF --algo.advantage.no_std_norm).
    As in OpenRLHF the scale is rsqrt(max(var, eps)) with the biased variance.
    """
    m = mask.bool()
    mean = masked_mean(x, m)
    out = x - mean
    if divide_std:
        var = masked_mean(out**2, m)
        out = out * torch.rsqrt(var.clamp_min(eps))
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, 0.0)


def compute_approx_kl(log_probs: Tensor, ref_log_probs: Tensor, estimator: KLEstimator,
                      mask: Tensor | None = None) -> Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1/k2/k3).

    log_probs, ref_log_probs, mask: [B, T] -> [B, T]; masked positions are 0.
    With x = logp - ref: k1 = x (unbiased, can be negative); k2 = x^2 / 2;
    k3 = exp(-x) - 1 + x (unbiased and >= 0), with x first clamped to >= -KL_CLAMP.
    Every result is clamped to [-KL_CLAMP, KL_CLAMP] (OpenRLHF): beyond the bound the
    penalty is constant and its gradient is exactly 0.
    """
    _check_choice("KL estimator", estimator, KL_ESTIMATORS)
    log_ratio = log_probs - ref_log_probs
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio**2
    else:
        # Below -KL_CLAMP k3 already exceeds the final cap; bounding x first keeps exp()
        # and its derivative finite, so the clamp's zero gradient is not 0 * inf = NaN.
        x = log_ratio.clamp(min=-KL_CLAMP)
        kl = (-x).exp() - 1 + x
    kl = kl.clamp(-KL_CLAMP, KL_CLAMP)
    # where() rather than *mask: an inf at a padded position must become 0, not NaN.
    return kl if mask is None else torch.where(mask.bool(), kl, 0.0)


def sequence_mean_kl(kl: Tensor, mask: Tensor) -> float:
    """Mean over sequences of each sequence's token-mean KL: [B, T], [B, T] -> float.

    This is the "kl" OpenRLHF logs and feeds its adaptive KL controller (experience_maker.py
    info["kl"], averaged per sample). Rows without response tokens are left out (OpenRLHF's
    masked_mean would make them NaN); 0 when no row has any.
    """
    m = mask.bool()
    has_tokens = m.any(dim=-1)
    if not bool(has_tokens.any()):
        return 0.0
    return float(masked_mean(kl, m, dim=-1)[has_tokens].mean())


def compute_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
                lambd: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens.

    rewards, values, mask: [B, T]. Returns (advantages [B, T], returns [B, T]) with
    returns = advantages + values and both 0 at masked positions. No normalisation.
    Masked positions are skipped rather than treated as zero-value states (verl), so
    the bootstrap after the last response token is 0 and holes in the mask are inert.
    """
    m = mask.bool()
    rewards, values = torch.where(m, rewards, 0.0), torch.where(m, values, 0.0)
    next_value = last_gae = torch.zeros_like(values[:, 0])
    reversed_adv: list[Tensor] = []
    # T is a few thousand at most and B-wide ops are cheap; a Python loop is clearer
    # than a scan and keeps autograd working if values ever carries a graph.
    for t in range(rewards.size(1) - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = torch.where(m[:, t], delta + gamma * lambd * last_gae, last_gae)
        next_value = torch.where(m[:, t], values[:, t], next_value)
        reversed_adv.append(last_gae)
    advantages = torch.where(m, torch.stack(reversed_adv[::-1], dim=1), 0.0)
    return advantages, torch.where(m, advantages + values, 0.0)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go sum_{k>=t} gamma^(k-t) r_k over unmasked tokens.

    rewards, mask: [B, T] -> [B, T]; masked positions are 0 and do not discount.
    """
    m = mask.bool()
    rewards = torch.where(m, rewards, 0.0)
    running = torch.zeros_like(rewards[:, 0])
    reversed_ret: list[Tensor] = []
    for t in range(rewards.size(1) - 1, -1, -1):
        running = torch.where(m[:, t], rewards[:, t] + gamma * running, running)
        reversed_ret.append(running)
    return torch.where(m, torch.stack(reversed_ret[::-1], dim=1), 0.0)


def token_level_rewards(scores: Tensor, kl: Tensor | None, mask: Tensor, kl_coef: float,
                        reward_clip_range: tuple[float, float] | None = None) -> Tensor:
    """Dense per-token reward: KL penalty on every token, sequence score on the last.

    scores: [B]; kl, mask: [B, T] (kl may be None = no penalty). Returns [B, T]:
    -kl_coef * kl on response tokens plus the (clipped) score at the last index where
    mask == 1. Rows with an empty response get all zeros.
    """
    m = mask.bool()
    scores = _as_float(scores)
    dtype = scores.dtype
    if reward_clip_range is not None:
        scores = scores.clamp(reward_clip_range[0], reward_clip_range[1])
    rewards = torch.zeros(m.shape, dtype=dtype, device=scores.device)
    if kl is not None:
        rewards = torch.where(m, -kl_coef * kl.to(dtype), rewards)
    # argmax returns the first maximum, so on the flipped mask it finds the last 1.
    last_idx = m.size(1) - 1 - m.flip(1).to(torch.int64).argmax(dim=1)
    placed = torch.where(m.any(dim=1), scores, 0.0)  # an all-0 row's argmax is bogus
    return rewards.scatter_add(1, last_idx.unsqueeze(1), placed.unsqueeze(1))


def shape_group_scores(scores: Tensor, n_samples_per_prompt: int,
                       estimator: AdvantageEstimator) -> Tensor:
    """Apply the estimator's per-prompt baseline to sequence scores.

    scores: [B] -> [B], rows grouped consecutively in groups of n = n_samples_per_prompt.
    group_norm: (r - mean_g) / (std_g + 1e-9), std unbiased (torch default), exactly as in
    OpenRLHF (verl uses 1e-6); a group of identical scores therefore maps to 0.
    dr_grpo, reinforce_baseline: r - mean_g.  rloo: r - mean of the other n-1 samples.
    reinforce, gae: unchanged.
    """
    _check_choice("advantage estimator", estimator, ADVANTAGE_ESTIMATORS)
    n = n_samples_per_prompt
    if n < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n}")
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [B], got shape {tuple(scores.shape)}")
    b = scores.numel()
    if b % n != 0:
        raise ValueError(f"batch of B={b} scores is not divisible by n_samples_per_prompt={n}; "
                         "rows must come in complete consecutive groups per prompt")
    if estimator not in _NEEDS_GROUP:
        return scores
    if n == 1:
        raise ValueError(f"advantage estimator {estimator!r} uses a per-prompt group baseline and "
                         "needs n_samples_per_prompt > 1 (got 1); use 'reinforce' or 'gae' for "
                         "one sample per prompt")
    g = _as_float(scores).reshape(-1, n)
    if estimator == "group_norm":
        out = (g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + 1e-9)
    elif estimator == "rloo":
        # r - (sum - r)/(n-1) rearranged to avoid a second pass.
        out = (g * n - g.sum(-1, keepdim=True)) / (n - 1)
    else:
        out = g - g.mean(-1, keepdim=True)
    return out.reshape(-1)


def effective_gamma(estimator: AdvantageEstimator, gamma: float) -> float:
    """The discount actually used: 1.0 for the group-baseline estimators (OpenRLHF forces it)."""
    return 1.0 if estimator in GAMMA_ONE_ESTIMATORS else gamma


def gamma_override_warning(estimator: AdvantageEstimator, gamma: float) -> str | None:
    """A one-line warning when --gamma is overridden for this estimator, else None."""
    if effective_gamma(estimator, gamma) == gamma:
        return None
    return (f"--gamma {gamma} is ignored for --advantage_estimator {estimator}: group-baseline estimators "
            "use gamma = 1.0 (as OpenRLHF does)")


def compute_advantages(estimator: AdvantageEstimator, scores: Tensor, mask: Tensor, *,
                       n_samples_per_prompt: int, kl: Tensor | None = None, kl_coef: float = 0.0,
                       values: Tensor | None = None, gamma: float = 1.0, lambd: float = 1.0,
                       reward_clip_range: tuple[float, float] | None = None,
                       std_norm: bool = True) -> tuple[Tensor, Tensor]:
    """Advantages and returns for one rollout batch.

    scores: [B]; mask, kl, values: [B, T]. Returns (advantages [B, T], returns [B, T]),
    both 0 at masked positions.
    gae: critic-based; advantages whitened over masked tokens, returns are GAE targets.
    group estimators: scores shaped per group, KL added per token, returns = discounted
    reward-to-go and advantages = returns; gae / reinforce / reinforce_baseline are then
    whitened (REINFORCE++), or only mean-centred with std_norm=False. group_norm, dr_grpo,
    rloo and reinforce_baseline always use gamma = 1 (effective_gamma, as OpenRLHF).
    reward_clip_range applies to the *shaped* scores, as in OpenRLHF. Whitening is over
    this batch only: callers that shard a rollout across ranks and want global statistics
    must whiten themselves.
    """
    _check_choice("advantage estimator", estimator, ADVANTAGE_ESTIMATORS)
    if estimator == "gae":
        if values is None:
            raise ValueError("advantage estimator 'gae' needs critic values, got values=None")
        rewards = token_level_rewards(scores, kl, mask, kl_coef, reward_clip_range)
        advantages, returns = compute_gae(rewards, values.to(rewards.dtype), mask, gamma, lambd)
        return masked_whiten(advantages, mask, divide_std=std_norm), returns
    shaped = shape_group_scores(scores, n_samples_per_prompt, estimator)
    rewards = token_level_rewards(shaped, kl, mask, kl_coef, reward_clip_range)
    returns = discounted_returns(rewards, mask, effective_gamma(estimator, gamma))
    if estimator in _WHITENED:
        advantages = masked_whiten(returns, mask, divide_std=std_norm)
    else:
        advantages = returns.clone()
    return advantages, returns


@dataclass
class KLControllerState:
    """Everything needed to resume a KL controller exactly (target/horizon are config)."""

    value: float


class _KLControllerBase:
    value: float

    def state(self) -> KLControllerState:
        return KLControllerState(value=self.value)

    def load_state(self, state: KLControllerState | Mapping[str, float]) -> None:
        self.value = float(state["value"] if isinstance(state, Mapping) else state.value)


class FixedKLController(_KLControllerBase):
    """Constant KL coefficient; load_state still restores it so resume is exact."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps


class AdaptiveKLController(_KLControllerBase):
    """Proportional controller steering observed KL towards ``target`` (Ziegler et al. 2019).

    The error is clipped to +-20% so one outlier batch cannot swing the coefficient,
    and scaled by n_steps/horizon so the adaptation speed is independent of batch size.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError("adaptive KL needs target > 0 and horizon > 0, "
                             f"got target={target}, horizon={horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def make_kl_controller(init_kl_coef: float, kl_target: float | None,
                       kl_horizon: int) -> FixedKLController | AdaptiveKLController:
    """Adaptive controller when a KL target is given, otherwise a fixed coefficient."""
    if kl_target is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, kl_target, kl_horizon)


def aggregate_loss(loss: Tensor, mask: Tensor, mode: LossAggMode, *,
                   num_tokens: float | None = None, num_seqs: float | None = None) -> Tensor:
    """Reduce a per-token loss [b, T] (mask [b, T]) to a scalar.

    token-mean: sum(loss) / num_tokens; seq-mean-token-sum: sum(loss) / num_seqs;
    seq-mean-token-mean: sum_i(mean_t loss_i) / num_seqs.
    num_tokens / num_seqs are totals over the whole mini-batch (all micro-batches and,
    if desired, all ranks): the divisor is then identical for every micro-batch, so
    summing micro-batch losses/gradients reproduces the full-batch value exactly.
    When None, this tensor's own masked-token count / row count is used. Denominators
    are clamped to >= 1 so an all-padding batch yields 0 rather than NaN.
    """
    _check_choice("loss aggregation mode", mode, LOSS_AGG_MODES)
    m = mask.bool()
    masked = torch.where(m, loss, 0.0)
    if mode == "token-mean":
        if num_tokens is None:
            return masked.sum() / m.sum().clamp_min(1).to(loss.dtype)
        return masked.sum() / max(float(num_tokens), 1.0)
    if mode == "seq-mean-token-sum":
        per_seq = masked.sum(-1)
    else:
        per_seq = masked.sum(-1) / m.sum(-1).clamp_min(1).to(loss.dtype)
    # Without num_seqs every row counts; the trainer passes the number of rows that still have
    # response tokens (rows masked out entirely, e.g. by dynamic filtering, are not samples).
    seqs = float(loss.size(0)) if num_seqs is None else float(num_seqs)
    return per_seq.sum() / max(seqs, 1.0)


def policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
                eps_clip: float, eps_clip_high: float | None = None, dual_clip: float | None = None,
                loss_type: PolicyLossType = "ppo", agg: LossAggMode = "token-mean",
                num_tokens: float | None = None, num_seqs: float | None = None,
                rollout_log_probs: Tensor | None = None, is_correction: ISCorrection | None = None
                ) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (optionally asymmetric, dual-clipped, or sequence-level GSPO).

    log_probs, old_log_probs, advantages, mask: [b, T]. old_log_probs and advantages
    are treated as constants by the caller. The ratio is clipped to
    [1 - eps_clip, 1 + eps_clip_high] (eps_clip_high None: eps_clip; OpenRLHF
    --actor.eps_clip_low_high). loss_type "ppo": per-token ratio exp(logp - old);
    "gspo" (Zheng et al. 2025, OpenRLHF PolicyLoss): every token of a sequence uses the
    sequence ratio exp(token-mean of logp - old), and the loss is always aggregated
    seq-mean-token-mean whatever ``agg`` says (OpenRLHF forces per-sample loss for GSPO).
    Dual clip (Ye et al. 2020) caps the loss of A < 0 tokens at -A * dual_clip.
    Returns (scalar loss, stats) with scalar, detached stats over masked tokens:
    clip_frac (tokens whose clipped term is the active one) = clip_frac_low (ratio below
    1 - eps_clip) + clip_frac_high (ratio above 1 + eps_clip_high), approx_kl (mean of
    old - new, i.e. k1 of KL(old||new)), ratio (mean), and dual_clip_frac when dual_clip is set.
    With ``is_correction`` (level not "off") and the engine's ``rollout_log_probs`` [b, T]: "ppo"
    multiplies each token's loss by rlrun.is_correction's train/rollout weight (after the dual
    clip, as OpenRLHF does; adds is_filter_frac and engine_kl to the stats); "gspo" takes its
    sequence ratio against the rollout log-probs instead of the old ones.
    """
    _check_choice("policy loss type", loss_type, POLICY_LOSS_TYPES)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (the loss is capped at -A*dual_clip), "
                         f"got {dual_clip}")
    eps_low = eps_clip
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    correcting = is_correction is not None and is_correction.level != "off"
    if correcting and rollout_log_probs is None:
        raise ValueError("is_correction needs the engine's rollout_log_probs")
    raw_log_ratio = log_probs - old_log_probs
    if loss_type == "gspo":
        # OpenRLHF exponentiates the sequence mean unbounded; the same +-20 bound as the
        # token path only matters where it would overflow to inf (and A = 0 give NaN).
        gspo_log_ratio = log_probs - rollout_log_probs if correcting else raw_log_ratio  # type: ignore[operator]
        seq_log_ratio = masked_mean(gspo_log_ratio, mask, dim=-1).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        ratio = seq_log_ratio.exp().unsqueeze(-1).expand_as(raw_log_ratio)
        agg = "seq-mean-token-mean"
    else:
        ratio = raw_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    surr_unclipped = -advantages * ratio
    surr_clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(surr_unclipped, surr_clipped)
    dual_active: Tensor | None = None
    if dual_clip is not None:
        # For A < 0 a huge ratio makes the clipped loss unbounded; cap it so a few stale
        # tokens cannot dominate the update. A >= 0 is already bounded by the clip.
        cap = -advantages * dual_clip
        dual_active = (advantages < 0) & (per_token > cap)
        per_token = torch.where(dual_active, cap, per_token)
    correction_stats: dict[str, Tensor] = {}
    if correcting and loss_type == "ppo":
        weights, correction_stats = correction_weights(old_log_probs, rollout_log_probs, mask, is_correction)  # type: ignore[arg-type]
        per_token = weights * per_token
    loss = aggregate_loss(per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        m = mask.bool()
        clipped = surr_clipped > surr_unclipped
        below = clipped & (ratio < 1.0 - eps_low)
        above = clipped & (ratio > 1.0 + eps_high)
        as_float = ratio.dtype
        stats = {"clip_frac": masked_mean(clipped.to(as_float), m),
                 "clip_frac_low": masked_mean(below.to(as_float), m),
                 "clip_frac_high": masked_mean(above.to(as_float), m),
                 "approx_kl": masked_mean(-raw_log_ratio, m), "ratio": masked_mean(ratio, m)}
        if dual_active is not None:
            stats["dual_clip_frac"] = masked_mean(dual_active.to(as_float), m)
        stats.update(correction_stats)
    return loss, {k: v.detach() for k, v in stats.items()}


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
               value_clip: float | None, agg: LossAggMode = "token-mean",
               num_tokens: float | None = None, num_seqs: float | None = None
               ) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic loss 0.5 * (v - R)^2, pessimistically clipped around old_values.

    values, old_values, returns, mask: [b, T]. With value_clip set the per-token loss
    is 0.5 * max((v - R)^2, (clip(v, old - vc, old + vc) - R)^2) (PPO2 / OpenRLHF).
    Returns (scalar loss, {"value_clip_frac": fraction of masked tokens where
    |v - old| > value_clip AND the clipped term is the larger one, i.e. the clip really
    cut the gradient}). Testing |v - old| directly matters: old + (v - old) is not
    exactly v in floating point, and the rounding alone can make the "clipped" term
    larger by one ulp for a token that was never clipped.
    """
    if value_clip is not None and value_clip < 0:
        raise ValueError(f"value_clip must be >= 0 or None, got {value_clip}")
    unclipped = (values - returns) ** 2
    if value_clip is None:
        per_token = 0.5 * unclipped
        clip_frac = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped = (v_clipped - returns) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        with torch.no_grad():
            active = ((values - old_values).abs() > value_clip) & (clipped > unclipped)
            clip_frac = masked_mean(active.to(values.dtype), mask)
    loss = aggregate_loss(per_token, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, {"value_clip_frac": clip_frac.detach()}


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) along the vocab: [B, T, V] -> [B, T].

    H = logsumexp(z) - sum_v p_v z_v, which never takes log of a tiny probability.
    -inf logits (banned tokens) contribute 0 instead of 0 * -inf = NaN. Computed in
    the input dtype; upcast or chunk over T at the call site if memory/precision matter.
    """
    p = torch.softmax(logits, dim=-1)
    p_z = torch.where(p > 0, p * logits, 0.0)
    return torch.logsumexp(logits, dim=-1) - p_z.sum(-1)


def log_probs_from_logits(logits: Tensor, labels: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of ``labels`` under softmax(logits / temperature).

    logits: [B, T, V], labels: [B, T] (int) -> [B, T]. The temperature must match the
    sampler's so that old/new/ref log-probs describe the distribution actually sampled.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if temperature != 1.0:
        logits = logits / temperature
    labels = labels.long()
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        # Row-by-row logsumexp keeps the peak extra memory at one [T, V] slice instead
        # of a full [B, T, V] log_softmax copy.
        lse = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
        return picked - lse
    # In bf16/fp16 "logit - logsumexp" loses precision (OpenRLHF measured this);
    # log_softmax is computed more carefully, so pay its copy one row at a time.
    return torch.stack([torch.log_softmax(r, dim=-1).gather(-1, lab.unsqueeze(-1)).squeeze(-1)
                        for r, lab in zip(logits, labels)])
