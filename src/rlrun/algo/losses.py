"""Per-token log-probabilities and entropy, and the scalar PPO losses built from them.

Stateless tensor functions: log-probs / entropy of logits, the policy surrogate (PPO clip,
dual clip, GSPO, off-policy importance correction), the clipped value loss and the loss
aggregation modes. Advantages, returns and KL estimators are in rlrun.algo.algorithms. Nothing
here runs a collective: global token / sequence counts for aggregation are passed in.

Shape conventions: ``B``/``b`` rows (a batch / a micro-batch), ``T`` response positions,
``V`` vocab. Masks are 0/1 (any dtype) with 1 on response tokens. Semantics follow
OpenRLHF (models/utils.py, models/loss.py) and verl core_algos.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from rlrun.algo.algorithms import check_choice, masked_mean

# ---- importance-sampling correction ------------------------------------------------------------------------------
# Correction of the train/rollout log-prob mismatch (OpenRLHF 0.11 --algo.advantage.is_correction_*).
#
# The engine that sampled a response (vLLM) and the actor that trains on it compute slightly different
# probabilities for the same tokens. The per-token importance weight pi_train / pi_rollout =
# exp(old_log_probs - rollout_log_probs) corrects for that. A gate reads one statistic per unit (each
# token, or each sequence's mean) and either drops units outside [low, high] ("mask": the survivors keep
# their per-token weight) or clamps the weight into [low, high] ("clip": token level, ratio gating only).
# Semantics and defaults follow OpenRLHF 0.11.2 models/loss.py PolicyLoss; the weights are constants (no
# gradient flows through them).
#
# Shapes: old_log_probs, rollout_log_probs, mask: [b, T].

ISLevel = Literal["off", "token", "seq"]
ISMode = Literal["mask", "clip"]
ISGating = Literal["ratio", "binary_kl", "tv"]
# Probabilities are kept inside (0, 1) so the binary KL's logs stay finite (OpenRLHF's bound).
_PROB_EPS = 1e-6


@dataclass(frozen=True)
class ISCorrection:
    level: ISLevel
    mode: ISMode
    gating: ISGating
    low: float
    high: float


def _masked_row_mean(x: Tensor, mask: Tensor) -> Tensor:
    """[b, T] -> [b, 1]: mean over each row's masked positions (0 for an empty row)."""
    m = mask.to(x.dtype)
    return ((x * m).sum(-1) / m.sum(-1).clamp_min(1)).unsqueeze(-1)


def gated_statistic(old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, c: ISCorrection) -> Tensor:
    """The statistic the gate reads: [b, T] at token level, [b, 1] at sequence level.

    ratio: exp(old - rollout) per token, or exp(row mean of old - rollout) per sequence (the geometric
    mean of the ratio); binary_kl / tv: the sampled token's Bernoulli KL(p_rollout || p_train) or |p - q|,
    per token or as the row mean."""
    log_ratio = (old_log_probs - rollout_log_probs).detach()
    seq = c.level == "seq"
    if c.gating == "ratio":
        return (_masked_row_mean(log_ratio, mask) if seq else log_ratio).exp()
    p = rollout_log_probs.detach().exp().clamp(_PROB_EPS, 1 - _PROB_EPS)
    q = old_log_probs.detach().exp().clamp(_PROB_EPS, 1 - _PROB_EPS)
    if c.gating == "binary_kl":
        stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
    else:
        stat = (p - q).abs()
    return _masked_row_mean(stat, mask) if seq else stat


def correction_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, c: ISCorrection
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token weights [b, T] to multiply into the per-token policy loss, and detached stats:
    is_filter_frac (units outside [low, high]: tokens, or sequences at seq level) and engine_kl (masked mean
    of rollout - old log-probs, OpenRLHF's vllm_kl)."""
    stat = gated_statistic(old_log_probs, rollout_log_probs, mask, c)
    token_weight = (old_log_probs - rollout_log_probs).detach().exp()
    outside = (stat < c.low) | (stat > c.high)
    if c.mode == "clip":
        weights = stat.clamp(c.low, c.high)
    else:
        weights = torch.where(outside, 0.0, token_weight)
    m = mask.bool()
    with torch.no_grad():
        if c.level == "seq":
            filtered = outside.float().mean()
        else:
            filtered = torch.where(m, outside.float(), 0.0).sum() / m.sum().clamp_min(1)
        diff = torch.where(m, (rollout_log_probs - old_log_probs).detach(), 0.0)
        engine_kl = diff.sum() / m.sum().clamp_min(1)
    return weights.expand_as(old_log_probs), {"is_filter_frac": filtered, "engine_kl": engine_kl}


def check_settings(c: ISCorrection) -> str | None:
    """The reason these settings are invalid (OpenRLHF's rules), or None."""
    if c.level == "off":
        return None
    if c.mode == "clip" and (c.level == "seq" or c.gating != "ratio"):
        return (
            "--is_correction_mode clip clamps the per-token ratio: it needs --is_correction_level token and "
            "--is_correction_gating ratio (a sequence statistic or a divergence can only mask)"
        )
    if c.gating != "ratio" and c.low > 0:
        return (
            f"--is_correction_gating {c.gating} is a divergence, bounded from above only: give "
            f"--is_correction_threshold 0 {c.high:g}"
        )
    if not 0 <= c.low <= c.high or c.high <= 0:
        return f"--is_correction_threshold needs 0 <= LOW <= HIGH and HIGH > 0, got {c.low:g} {c.high:g}"
    return None


PolicyLossType = Literal["ppo", "gspo"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]

POLICY_LOSS_TYPES: tuple[str, ...] = get_args(PolicyLossType)
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)

# Bound on log-ratios fed to exp(): keeps exp() finite in fp32 so A=0 tokens cannot
# produce 0*inf = NaN (verl uses the same bound); beyond it the sample is garbage anyway.
_MAX_LOG_RATIO = 20.0


def aggregate_loss(
    loss: Tensor, mask: Tensor, mode: LossAggMode, *, num_tokens: float | None = None, num_seqs: float | None = None
) -> Tensor:
    """Reduce a per-token loss [b, T] (mask [b, T]) to a scalar.

    token-mean: sum(loss) / num_tokens; seq-mean-token-sum: sum(loss) / num_seqs;
    seq-mean-token-mean: sum_i(mean_t loss_i) / num_seqs.
    num_tokens / num_seqs are totals over the whole mini-batch (all micro-batches and,
    if desired, all ranks): the divisor is then identical for every micro-batch, so
    summing micro-batch losses/gradients reproduces the full-batch value exactly.
    When None, this tensor's own masked-token count / row count is used. Denominators
    are clamped to >= 1 so an all-padding batch yields 0 rather than NaN.
    """
    check_choice("loss aggregation mode", mode, LOSS_AGG_MODES)
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


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    dual_clip: float | None = None,
    loss_type: PolicyLossType = "ppo",
    agg: LossAggMode = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    rollout_log_probs: Tensor | None = None,
    is_correction: ISCorrection | None = None,
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
    multiplies each token's loss by rlrun.algo.losses's train/rollout weight (after the dual
    clip, as OpenRLHF does; adds is_filter_frac and engine_kl to the stats); "gspo" takes its
    sequence ratio against the rollout log-probs instead of the old ones.
    """
    check_choice("policy loss type", loss_type, POLICY_LOSS_TYPES)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (the loss is capped at -A*dual_clip), got {dual_clip}")
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
        stats = {
            "clip_frac": masked_mean(clipped.to(as_float), m),
            "clip_frac_low": masked_mean(below.to(as_float), m),
            "clip_frac_high": masked_mean(above.to(as_float), m),
            "approx_kl": masked_mean(-raw_log_ratio, m),
            "ratio": masked_mean(ratio, m),
        }
        if dual_active is not None:
            stats["dual_clip_frac"] = masked_mean(dual_active.to(as_float), m)
        stats.update(correction_stats)
    return loss, {k: v.detach() for k, v in stats.items()}


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    value_clip: float | None,
    agg: LossAggMode = "token-mean",
    num_tokens: float | None = None,
    num_seqs: float | None = None,
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
    return torch.stack(
        [torch.log_softmax(r, dim=-1).gather(-1, lab.unsqueeze(-1)).squeeze(-1) for r, lab in zip(logits, labels)]
    )
