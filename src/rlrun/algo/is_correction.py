"""Correction of the train/rollout log-prob mismatch (OpenRLHF 0.11 --algo.advantage.is_correction_*).

The engine that sampled a response (vLLM) and the actor that trains on it compute slightly different
probabilities for the same tokens. The per-token importance weight pi_train / pi_rollout =
exp(old_log_probs - rollout_log_probs) corrects for that. A gate reads one statistic per unit (each
token, or each sequence's mean) and either drops units outside [low, high] ("mask": the survivors keep
their per-token weight) or clamps the weight into [low, high] ("clip": token level, ratio gating only).
Semantics and defaults follow OpenRLHF 0.11.2 models/loss.py PolicyLoss; the weights are constants (no
gradient flows through them).

Shapes: old_log_probs, rollout_log_probs, mask: [b, T].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

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


def correction_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor,
                       c: ISCorrection) -> tuple[Tensor, dict[str, Tensor]]:
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
        return ("--is_correction_mode clip clamps the per-token ratio: it needs --is_correction_level token and "
                "--is_correction_gating ratio (a sequence statistic or a divergence can only mask)")
    if c.gating != "ratio" and c.low > 0:
        return (f"--is_correction_gating {c.gating} is a divergence, bounded from above only: give "
                f"--is_correction_threshold 0 {c.high:g}")
    if not 0 <= c.low <= c.high or c.high <= 0:
        return f"--is_correction_threshold needs 0 <= LOW <= HIGH and HIGH > 0, got {c.low:g} {c.high:g}"
    return None
