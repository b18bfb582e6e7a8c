"""Rollout correction: the engine that sampled a response (vLLM, the native decoder) and the actor that trains on it
give the same tokens slightly different probabilities; importance weights pi_train / pi_rollout, bounded or masked,
correct the policy loss for that, and rejection sampling drops tokens or sequences whose mismatch is too large.

One implementation (`RolloutCorrection`, `correct`) under both peers' settings:
- verl's `algorithm.rollout_correction` (verl 0.10, `verl/trainer/ppo/rollout_corr_helper.py` at 1dda039, and
  `docs/algo/rollout_corr.md`): `rollout_is` token / sequence weights (the sequence's PRODUCT of token ratios)
  truncated above at `rollout_is_threshold` (TIS) or, for a "LOW_HIGH" threshold, zeroed outside it (IcePop);
  `rollout_is_batch_normalize`; `rollout_rs` rejection by k1/k2/k3 divergences per token or per sequence (sum, mean,
  max), which changes the response mask before the advantages; `bypass_mode`, where the loss's old log-probs are the
  engine's (`verl_correction`, and `VERL_PRESETS`: verl's RolloutCorrectionConfig constructors by name).
- OpenRLHF 0.11's `--algo.advantage.is_correction_*` (openrlhf/models/loss.py PolicyLoss): token weights gated per
  token or by each sequence's geometric-mean ratio (or the sampled token's binary KL / total variation), clamped into
  [LOW, HIGH] (TIS) or zeroed outside it (ICEPOP, seq-mask-tis) (`openrlhf_correction`).

The weights are constants (no gradient), 0 at padding; every log-ratio is bounded to +-20 before exp() (verl's
safety bound; OpenRLHF has none). `correct` also returns verl's `rollout_corr/*` diagnostics (the mismatch KL, the
perplexities, chi-square, the weights' spread and effective sample size, the rejected fractions) and
`rollout_corr/is_filter_frac`, the share of units outside the bounds.

Shapes: B rows, T response positions; train_log_probs, rollout_log_probs, mask: [B, T].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

from rlrun.algo.algorithms import check_choice

WeightUnit = Literal["token", "sequence"]
Gate = Literal["weight", "geo_mean", "binary_kl", "tv"]
OutOfBounds = Literal["clamp", "zero"]
Divergence = Literal["k1", "k2", "k3"]
Reduction = Literal["token", "seq_sum", "seq_mean", "seq_max"]
BypassLoss = Literal["ppo_clip", "reinforce"]

SAFETY_BOUND = 20.0  # on every log-ratio before exp() (verl's rollout_corr_helper SAFETY_BOUND)
# Probabilities are kept inside (0, 1) so the binary KL's logs stay finite (OpenRLHF's bound).
_PROB_EPS = 1e-6
PREFIX = "rollout_corr/"


@dataclass(frozen=True)
class ISWeights:
    """How each token's importance weight is formed and bounded.

    unit: each token's ratio exp(train - rollout), or the sequence's product exp(sum of log-ratios) on every token.
    gate: what `bounds` test: the weight itself (verl, TIS/IcePop), each sequence's geometric-mean ratio
    (OpenRLHF seq), or the sampled token's Bernoulli KL(p_rollout || p_train) / |p_rollout - p_train| per token (or
    the row's mean with gate_rows). out_of_bounds: "clamp" the weight into bounds (only with gate "weight"), or
    "zero" the unit's weight (the tokens stay in the loss's denominators). low 0 / high inf: no bound that side."""

    unit: WeightUnit = "token"
    bounds: tuple[float, float] = (0.0, math.inf)
    out_of_bounds: OutOfBounds = "clamp"
    gate: Gate = "weight"
    gate_rows: bool = False
    batch_normalize: bool = False  # divide by the weights' mean (tokens, or sequences' means for unit "sequence")

    @property
    def per_sequence(self) -> bool:
        """Whether a whole sequence is in or out of bounds at once."""
        return self.unit == "sequence" or self.gate == "geo_mean" or self.gate_rows


@dataclass(frozen=True)
class Rejection:
    """One verl rollout_rs option: `reduce` of the per-token `divergence` must lie in bounds, or the token (the
    sequence, for the seq_* reductions) leaves the response mask. k1 = log(pi_rollout / pi_train) bounded in
    [log low, log high]; k2 = (log-ratio)^2 / 2 and k3 = r - 1 - log r bounded above by high."""

    divergence: Divergence
    reduce: Reduction
    low: float | None  # k1 only
    high: float

    @property
    def name(self) -> str:
        return f"{self.reduce}_{self.divergence}"


@dataclass(frozen=True)
class RolloutCorrection:
    """weights None: no importance weights; bypass: the loss takes the engine's log-probs as its old log-probs
    (verl bypass_mode: no actor scoring pass) and weights/rejections come from the current policy per micro-batch;
    bypass_loss "reinforce" trains -A log pi * w (rlrun's gpg loss) instead of the configured clipped loss."""

    weights: ISWeights | None = None
    rejection: tuple[Rejection, ...] = ()
    bypass: bool = False
    bypass_loss: BypassLoss = "ppo_clip"

    @property
    def active(self) -> bool:
        return self.weights is not None or bool(self.rejection) or self.bypass

    @property
    def needs_old_log_probs(self) -> bool:
        """The decoupled mode weighs pi_old / pi_rollout: the actor's scoring pass must run."""
        return self.active and not self.bypass


OFF = RolloutCorrection()


@dataclass
class Corrected:
    weights: Tensor | None  # [B, T] detached, 0 at padding; None without importance weights
    keep: Tensor  # [B, T] bool: False where rejection sampling drops the token
    metrics: dict[str, float]


# ---- the peers' settings ----------------------------------------------------------------------------------------

RS_OPTIONS: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def parse_is_threshold(threshold: float | str) -> tuple[float, float, OutOfBounds]:
    """verl's rollout_is_threshold: a number U truncates the weights above (TIS: (0, U, clamp)); "LOW_HIGH" zeroes
    those outside [LOW, HIGH] (IcePop: (LOW, HIGH, zero))."""
    text = str(threshold).strip()
    low, sep, high = text.partition("_")
    try:
        values = (float(low), float(high)) if sep else (0.0, float(text))
    except ValueError:
        raise ValueError(
            f"rollout_is_threshold {threshold!r} is neither a number (truncation) nor LOW_HIGH (IcePop, e.g. 0.5_5.0)"
        ) from None
    # NaN passes every comparison below as False (the weights would all be NaN, every update skipped): refused first
    if not all(math.isfinite(v) for v in values) or values[1] <= 0 or (sep and not 0 < values[0] <= values[1]):
        raise ValueError(f"rollout_is_threshold {threshold!r} needs finite 0 < LOW <= HIGH (or one finite HIGH > 0)")
    return values[0], values[1], "zero" if sep else "clamp"


def parse_rejection(options: str, thresholds: str | float | None) -> tuple[Rejection, ...]:
    """verl's rollout_rs (comma list of RS_OPTIONS) with rollout_rs_threshold (one entry, or one per option): for k1
    "LOW_HIGH" or HIGH (LOW = 1 / HIGH), for k2/k3 a HIGH > 0."""
    names = list(dict.fromkeys(o.strip() for o in options.split(",") if o.strip()))
    for name in names:
        check_choice("rollout_rs option", name, RS_OPTIONS)
    if thresholds is None:
        raise ValueError(f"rollout_rs {options} needs rollout_rs_threshold (one value, or one per option)")
    entries = [t.strip() for t in str(thresholds).split(",")]
    if len(entries) == 1:
        entries *= len(names)
    if len(entries) != len(names):
        raise ValueError(f"rollout_rs_threshold {thresholds!r} has {len(entries)} entries for {len(names)} options")
    rules = []
    for name, entry in zip(names, entries):
        reduce, divergence = name.rsplit("_", 1)
        low_text, sep, high_text = entry.partition("_")
        try:
            high = float(high_text if sep else low_text)
            low = float(low_text) if sep else (1.0 / high if divergence == "k1" and high > 0 else None)
        except ValueError:
            raise ValueError(f"rollout_rs_threshold entry {entry!r} for {name} is not a number or LOW_HIGH") from None
        if divergence != "k1" and sep:
            raise ValueError(f"rollout_rs {name} is bounded above only: give one number, not {entry!r}")
        finite = math.isfinite(high) and (low is None or math.isfinite(low))  # NaN would reject every token
        if not finite or high <= 0 or (low is not None and not 0 < low <= high):
            raise ValueError(f"rollout_rs_threshold {entry!r} for {name} needs finite 0 < LOW <= HIGH")
        rules.append(Rejection(divergence, reduce, low, high))  # type: ignore[arg-type]  # checked by check_choice
    return tuple(rules)


def verl_correction(
    rollout_is: str | None,
    rollout_is_threshold: float | str | None = 2.0,
    batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: float | str | None = None,
    bypass_mode: bool = False,
    loss_type: BypassLoss = "ppo_clip",
) -> RolloutCorrection:
    """verl's algorithm.rollout_correction keys -> the correction (rollout_is None/"off": no weights)."""
    weights = None
    if rollout_is is not None and rollout_is != "off":
        check_choice("rollout_is", rollout_is, ("token", "sequence"))
        if rollout_is_threshold is not None:  # verl: a set rollout_is with no threshold computes no weights
            low, high, bound = parse_is_threshold(rollout_is_threshold)
            weights = ISWeights(rollout_is, (low, high), bound, batch_normalize=batch_normalize)  # type: ignore[arg-type]
    check_choice("rollout_correction.loss_type", loss_type, get_args(BypassLoss))
    rules = parse_rejection(rollout_rs, rollout_rs_threshold) if rollout_rs else ()
    return RolloutCorrection(weights, rules, bypass_mode, loss_type)


def openrlhf_correction(level: str, mode: str, gating: str, low: float, high: float) -> RolloutCorrection:
    """OpenRLHF 0.11.2's --algo.advantage.is_correction_{level,mode,gating,threshold} -> the correction: token
    weights pi_train/pi_rollout, gated per token (level token) or per sequence (level seq: the geometric-mean ratio,
    or the mean divergence), clamped into [low, high] (mode clip) or zeroed outside (mode mask)."""
    if level == "off":
        return OFF
    gate: Gate = "weight" if gating == "ratio" and level == "token" else "geo_mean" if gating == "ratio" else gating  # type: ignore[assignment]
    bound: OutOfBounds = "clamp" if mode == "clip" else "zero"
    return RolloutCorrection(ISWeights("token", (low, high), bound, gate, gate_rows=level == "seq"))


def check_openrlhf(level: str, mode: str, gating: str, low: float, high: float) -> str | None:
    """The reason OpenRLHF's is_correction settings are invalid (its own rules), or None."""
    if level == "off":
        return None
    if mode == "clip" and (level == "seq" or gating != "ratio"):
        return (
            "--is_correction_mode clip clamps the per-token ratio: it needs --is_correction_level token and "
            "--is_correction_gating ratio (a sequence statistic or a divergence can only mask)"
        )
    if gating != "ratio" and low > 0:
        return (
            f"--is_correction_gating {gating} is a divergence, bounded from above only: give "
            f"--is_correction_threshold 0 {high:g}"
        )
    if not (math.isfinite(low) and math.isfinite(high)) or not 0 <= low <= high or high <= 0:
        return f"--is_correction_threshold needs finite 0 <= LOW <= HIGH and HIGH > 0, got {low:g} {high:g}"
    return None


def _preset(**keys: object) -> dict[str, object]:
    return keys


# verl's RolloutCorrectionConfig constructors (verl/trainer/config/algorithm.py at 1dda039), with their default
# arguments, as verl_correction keyword arguments. Keys left out take verl's dataclass defaults for the preset.
VERL_PRESETS: dict[str, dict[str, object]] = {
    "decoupled_token_is": _preset(rollout_is="token", rollout_is_threshold=2.0),
    "decoupled_seq_is": _preset(rollout_is="sequence", rollout_is_threshold=2.0),
    "decoupled_token_icepop": _preset(rollout_is="token", rollout_is_threshold="0.5_5.0"),
    "decoupled_seq_is_rs": _preset(
        rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"
    ),
    "decoupled_geo_rs": _preset(rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"),
    "bypass_ppo_clip": _preset(rollout_is=None, bypass_mode=True, loss_type="ppo_clip"),
    "bypass_ppo_clip_geo_rs": _preset(
        rollout_is=None, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001", bypass_mode=True
    ),
    "bypass_ppo_clip_k3_rs": _preset(
        rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01, bypass_mode=True
    ),
    "bypass_pg_is": _preset(rollout_is="sequence", rollout_is_threshold=2.0, bypass_mode=True, loss_type="reinforce"),
    "bypass_pg_token_icepop": _preset(
        rollout_is="token", rollout_is_threshold="0.5_5.0", bypass_mode=True, loss_type="reinforce"
    ),
    "bypass_pg_geo_rs": _preset(
        rollout_is=None,
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.999_1.001",
        bypass_mode=True,
        loss_type="reinforce",
    ),
    "decoupled_geo_rs_seq_tis": _preset(
        rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"
    ),
    "decoupled_geo_rs_token_tis": _preset(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001"
    ),
    "bypass_pg_geo_rs_seq_tis": _preset(
        rollout_is="sequence",
        rollout_is_threshold=2.0,
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.999_1.001",
        bypass_mode=True,
        loss_type="reinforce",
    ),
    "bypass_pg_geo_rs_token_tis": _preset(
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="seq_mean_k1",
        rollout_rs_threshold="0.999_1.001",
        bypass_mode=True,
        loss_type="reinforce",
    ),
    "decoupled_k3_rs": _preset(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01),
    "decoupled_k3_rs_seq_tis": _preset(
        rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01
    ),
    "decoupled_k3_rs_token_tis": _preset(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01
    ),
    "disabled": _preset(rollout_is=None),
}


def preset(name: str) -> RolloutCorrection:
    check_choice("rollout correction preset", name, tuple(VERL_PRESETS))
    return verl_correction(**VERL_PRESETS[name])  # type: ignore[arg-type]


# ---- the computation ---------------------------------------------------------------------------------------------


def _row_mean(x: Tensor, m: Tensor) -> Tensor:
    """[B, T] -> [B]: mean over each row's valid positions (0 for an empty row)."""
    return (x * m).sum(-1) / m.sum(-1).clamp_min(1)


def _mean(x: Tensor, m: Tensor) -> float:
    return float((x * m).sum() / m.sum().clamp_min(1))


def _weights(delta: Tensor, seq: Tensor, train: Tensor, rollout: Tensor, m: Tensor, w: ISWeights) -> tuple:
    """(raw weights, the statistic the gate reads, which units are outside the bounds) [B, T]."""
    raw = (delta.exp() if w.unit == "token" else seq.exp().unsqueeze(-1).expand_as(delta)) * m
    if w.gate == "weight":
        stat = raw
    elif w.gate == "geo_mean":
        stat = _row_mean(delta, m).exp().unsqueeze(-1).expand_as(delta)
    else:
        p = rollout.exp().clamp(_PROB_EPS, 1 - _PROB_EPS)
        q = train.exp().clamp(_PROB_EPS, 1 - _PROB_EPS)
        stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log() if w.gate == "binary_kl" else (p - q).abs()
        if w.gate_rows:
            stat = _row_mean(stat, m).unsqueeze(-1).expand_as(delta)
    low, high = w.bounds
    outside = ((stat < low) | (stat > high)) & m.bool()
    return raw, stat, outside


def _divergence(delta: Tensor, rule: Rejection) -> Tensor:
    if rule.divergence == "k1":
        return -delta  # log(pi_rollout / pi_train)
    if rule.divergence == "k2":
        return 0.5 * delta**2
    return delta.exp() - 1 - delta


def _rejected(delta: Tensor, m: Tensor, rule: Rejection) -> tuple[Tensor, Tensor]:
    """(keep [B, T] bool, the statistic [B, T]) of one rejection rule."""
    k = _divergence(delta, rule) * m
    if rule.reduce == "token":
        stat = k
    elif rule.reduce == "seq_sum":
        stat = k.sum(-1, keepdim=True).expand_as(k)
    elif rule.reduce == "seq_mean":
        stat = (k.sum(-1) / (m.sum(-1) + 1e-8)).unsqueeze(-1).expand_as(k)
    else:
        stat = torch.where(m.bool(), k, -math.inf).amax(-1).clamp_min(0).unsqueeze(-1).expand_as(k)
    if rule.divergence == "k1":
        assert rule.low is not None  # parse_rejection gives k1 its lower bound
        keep = (stat >= math.log(rule.low)) & (stat <= math.log(rule.high))
    else:
        keep = stat <= rule.high
    return keep | ~m.bool(), stat


def correct(
    train_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, c: RolloutCorrection, with_metrics: bool = True
) -> Corrected:
    """The weights and the rejection mask of `c` for one batch (or micro-batch), and its metrics (rollout_corr/*).

    train_log_probs: the actor's log-probs of the sampled tokens (pi_old; in bypass mode the current policy's,
    detached); rollout_log_probs: the engine's; mask: the response mask."""
    m = mask.to(train_log_probs.dtype)
    train, rollout = train_log_probs.detach().to(m.dtype), rollout_log_probs.detach().to(m.dtype)
    log_ratio = (train - rollout) * m
    delta = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq = log_ratio.sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    metrics = _diagnostics(train, rollout, delta, seq, m) if with_metrics else {}
    weights = None
    if (w := c.weights) is not None:
        raw, _, outside = _weights(delta, seq, train, rollout, m, w)
        low, high = w.bounds
        weights = (raw.clamp(low, high) if w.out_of_bounds == "clamp" else torch.where(outside, 0.0, raw)) * m
        if with_metrics:
            metrics |= _is_metrics(weights, raw, seq, outside, m, w)
        if w.batch_normalize:
            mean = _mean(weights, m) if w.unit == "token" else float(_valid_row_means(weights, m).mean())
            if mean > 1e-8:
                weights = weights / mean
            metrics[PREFIX + "rollout_is_batch_norm_factor"] = mean if mean > 1e-8 else 1.0
    keep = torch.ones_like(m, dtype=torch.bool)
    for rule in c.rejection:
        kept, stat = _rejected(delta, m, rule)
        keep &= kept
        if with_metrics:
            metrics |= _rs_metrics(rule, kept, stat, m)
    if c.rejection and with_metrics:
        dropped = (~keep).to(m.dtype) * m
        rows = m.sum(-1) > 0
        metrics[PREFIX + "rollout_rs_masked_fraction"] = _mean(dropped, m)
        metrics[PREFIX + "rollout_rs_seq_masked_fraction"] = float(
            (dropped.sum(-1) > 0)[rows].float().mean() if rows.any() else 0.0
        )
    return Corrected(weights, keep, metrics)


def _valid_row_means(x: Tensor, m: Tensor) -> Tensor:
    rows = m.sum(-1) > 0
    return _row_mean(x, m)[rows] if rows.any() else x.new_zeros(1)


def _diagnostics(train: Tensor, rollout: Tensor, delta: Tensor, seq: Tensor, m: Tensor) -> dict[str, float]:
    """verl's off-policy diagnostics: perplexities, the mismatch KL (k1 of KL(rollout || train); k3), chi-square."""
    rows = m.sum(-1) > 0
    if not rows.any():
        return {}
    train_logppl, rollout_logppl = -_row_mean(train, m)[rows], -_row_mean(rollout, m)[rows]
    diff = train_logppl - rollout_logppl  # mean rollout log-prob minus mean train log-prob, per row
    out = {
        "training_ppl": float(train_logppl.exp().mean()),
        "training_log_ppl": float(train_logppl.mean()),
        "rollout_ppl": float(rollout_logppl.exp().mean()),
        "rollout_log_ppl": float(rollout_logppl.mean()),
        "kl": _mean(rollout - train, m),
        "k3_kl": _mean(delta.exp() - delta - 1, m),
        "log_ppl_diff": float(diff.mean()),
        "log_ppl_abs_diff": float(diff.abs().mean()),
        "log_ppl_diff_max": float(diff.max()),
        "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": float(diff.exp().mean()),
        "chi2_token": _mean((2 * delta).exp(), m) - 1,
        "chi2_seq": float((2 * seq[rows]).exp().mean()) - 1,
    }
    return {PREFIX + k: v for k, v in out.items()}


def _is_metrics(
    weights: Tensor, raw: Tensor, seq: Tensor, outside: Tensor, m: Tensor, w: ISWeights
) -> dict[str, float]:
    """verl's rollout_is_* metrics of the applied weights (before batch normalisation), and rlrun's
    is_filter_frac: the share of tokens (sequences, for per-sequence gates) outside the bounds."""
    low, high = w.bounds
    lower = low if low > 0 else (1.0 / high if math.isfinite(high) else 0.0)
    valid, rows = m.bool(), m.sum(-1) > 0
    capped = weights.clamp(0.0, high)
    mean_capped = _mean(capped, m)
    out = {
        "rollout_is_mean": _mean(weights, m),
        "rollout_is_std": max(0.0, _mean(capped**2, m) - mean_capped**2) ** 0.5 if m.sum() > 1 else 0.0,
        "rollout_is_eff_sample_size": 1.0 / max(_mean((capped / (mean_capped + 1e-8)) ** 2, m), 1e-12),
    }
    if w.unit == "token":
        out |= {
            "rollout_is_max": float(weights[valid].max()) if valid.any() else 0.0,
            "rollout_is_min": float(weights[valid].min()) if valid.any() else 0.0,
            "rollout_is_ratio_fraction_high": _mean((raw > high).to(m.dtype), m),
            "rollout_is_ratio_fraction_low": _mean((raw < lower).to(m.dtype), m),
        }
    elif rows.any():
        out |= {
            "rollout_is_max": math.exp(float(seq[rows].max())),
            "rollout_is_min": math.exp(float(seq[rows].min())),
            "rollout_is_ratio_fraction_high": float((seq[rows] > math.log(high)).float().mean()),
            "rollout_is_ratio_fraction_low": float((seq[rows] < math.log(lower)).float().mean()) if lower > 0 else 0.0,
        }
    if rows.any():
        per_row, raw_rows = _valid_row_means(weights, m), _valid_row_means(raw, m)
        out |= {
            "rollout_is_seq_mean": float(per_row.mean()),
            "rollout_is_seq_std": float(per_row.std()) if per_row.numel() > 1 else 0.0,
            "rollout_is_seq_max": float(per_row.max()),
            "rollout_is_seq_min": float(per_row.min()),
            "rollout_is_seq_max_deviation": float((per_row - 1).abs().max()),
            "rollout_is_seq_fraction_high": float((raw_rows > high).float().mean()),
            "rollout_is_seq_fraction_low": float((raw_rows < lower).float().mean()),
        }
    if w.out_of_bounds == "zero":
        out["rollout_is_oob_ratio"] = _mean(outside.to(m.dtype), m)
    if w.per_sequence:
        out["is_filter_frac"] = float(outside.any(-1)[rows].float().mean()) if rows.any() else 0.0
    else:
        out["is_filter_frac"] = _mean(outside.to(m.dtype), m)
    return {PREFIX + k: v for k, v in out.items()}


def _rs_metrics(rule: Rejection, kept: Tensor, stat: Tensor, m: Tensor) -> dict[str, float]:
    valid = m.bool()
    name = f"{PREFIX}rollout_rs_{rule.name}_"
    values = stat[valid] if rule.reduce == "token" else stat[:, 0][m.sum(-1) > 0]
    if not values.numel():
        return {}
    return {
        name + "mean": _mean(stat, m),
        name + "max": float(values.max()),
        name + "min": float(values.min()),
        name + "masked_fraction": _mean((~kept).to(m.dtype), m),
    }
