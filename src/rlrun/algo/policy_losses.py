"""The policy-gradient surrogates: PPO, GSPO and verl's registry of 2025-2026 losses, as pure tensor functions.

`policy_loss` is the one entry: it picks the loss by name (`PolicyLossType`, verl's
`actor_rollout_ref.actor.policy_loss.loss_mode` with `vanilla` -> `ppo`), multiplies each token's loss by the
rollout-correction weights when there are any (rlrun.algo.rollout_correction; verl's `rollout_is_weights`, after
every clip, as verl does) and aggregates with the global token / sequence counts the caller passes
(rlrun.algo.losses.aggregate_loss), so micro-batches and data parallelism give the full batch's gradient.

Each loss follows the formula of verl 0.10's `verl/trainer/ppo/core_algos.py` (read at 1dda039, 2026-08) and its
paper, written from the math (tests/algo/test_policy_losses.py checks hand-computed cases):

- ppo (verl `vanilla`): clipped ratio, optional dual clip (Schulman 2017; Ye 2020).
- gspo: one ratio per sequence, exp(token-mean log-ratio), the gradient through the sequence's mean (Zheng 2025):
  OpenRLHF's PolicyLoss form (--policy_loss_type gspo).
- gspo_token: verl's gspo (what verl's loss_mode=gspo maps to): the same value, but each token's loss is its own
  advantage times the sequence ratio whose gradient reaches only that token's log-prob (the paper's GSPO-token), the
  log-ratio clamped at 10 above, no dual clip. The two differ in their gradients when advantages vary within a
  sequence (KL in the reward, token-level weights).
- cispo: REINFORCE weighted by the clipped, detached ratio; no token loses its gradient (MiniMax-M1, 2025).
- sapo: a smooth sigmoid gate sigma(tau (r - 1)) 4 / tau instead of the clip, tau by the advantage's sign (Qwen 2025).
- gpg: plain -A log pi (GPG, Chu 2025); with rollout weights it is also verl's bypass-mode "reinforce".
- clip_cov: PPO with a random ~clip_cov_ratio of the tokens whose advantage/log-prob covariance lies in
  (lb, ub) detached; kl_cov: the top kl_cov_ratio by covariance get a |log-ratio| penalty (Cui 2025).
- geo_mean: GMPO, the geometric mean of token ratios clipped in log space, times the sequence's mean advantage
  (Zhao 2025).
- dppo_tv / dppo_kl: DPPO, a truncated detached ratio times log pi, masked where the sampled token's probability
  left a total-variation / binary-KL trust region in the advantage's direction (Qi 2026).
- dro: -(A log pi - beta/2 (log pi - log pi_old)^2), a quadratic soft trust region (verl's `dro`).

Where rlrun departs from verl, on purpose: every log-ratio is bounded to +-20 before exp() (verl leaves clip_cov,
kl_cov and geo_mean unbounded, where a stale token can give 0 * inf = NaN); geo_mean's rows are averaged over the
mini-batch's sequences (the caller's num_seqs) rather than over the micro-batch's rows including empty ones.
The metric names are rlrun's (clip_frac, approx_kl, ...); docs/usage.md maps them onto verl's.

Shapes: ``b`` rows of a micro-batch, ``T`` response positions; every tensor argument is [b, T]; masks are 0/1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
from torch import Tensor

from rlrun.algo.algorithms import check_choice, masked_mean
from rlrun.algo.losses import LossAggMode, aggregate_loss

PolicyLossType = Literal[
    "ppo", "gspo", "gspo_token", "cispo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dppo_tv", "dppo_kl", "dro"
]
POLICY_LOSS_TYPES: tuple[str, ...] = get_args(PolicyLossType)

# Bound on log-ratios fed to exp(): keeps exp() finite in fp32 so A=0 tokens cannot
# produce 0*inf = NaN (verl uses the same bound); beyond it the sample is garbage anyway.
MAX_LOG_RATIO = 20.0
# DPPO's default ratio cap: verl's clip_ratio_c default, which its dppo losses read as the cap.
DPPO_RATIO_CAP = 3.0


@dataclass(frozen=True)
class PolicyLossParams:
    """The loss-specific parameters (defaults: verl's actor config). The clip range and the dual clip are
    policy_loss's own arguments."""

    sapo_tau_pos: float = 1.0  # sapo: the gate's temperature for A > 0 (verl actor.tau_pos)
    sapo_tau_neg: float = 1.05  # ... and for A <= 0 (verl actor.tau_neg)
    clip_cov_ratio: float = 2e-4  # clip_cov: share of the micro-batch's tokens to detach (at least one)
    clip_cov_bounds: tuple[float, float] = (1.0, 5.0)  # clip_cov: the covariance window (lb, ub), exclusive
    kl_cov_ratio: float = 2e-4  # kl_cov: share of the tokens penalised (at least one)
    kl_cov_coef: float = 0.1  # kl_cov: the |log-ratio| penalty's weight (verl policy_loss.ppo_kl_coef)
    dro_beta: float | None = None  # dro: the quadratic penalty's weight, required


@dataclass(frozen=True)
class _Inputs:
    log_probs: Tensor  # carries the gradient
    old_log_probs: Tensor
    advantages: Tensor
    mask: Tensor  # bool
    eps_low: float
    eps_high: float
    dual_clip: float | None
    p: PolicyLossParams

    def log_ratio(self) -> Tensor:
        return (self.log_probs - self.old_log_probs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)

    def mean(self, x: Tensor) -> Tensor:
        return masked_mean(x.to(self.log_probs.dtype), self.mask)


@dataclass
class _PerToken:
    """A loss's per-token values [b, T] (or per row [b] when `rows`), and its detached stats."""

    loss: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)
    agg: LossAggMode | None = None  # a mode the loss forces (gspo, sapo)
    rows: bool = False  # geo_mean: one value per sequence


def _base_stats(x: _Inputs, ratio: Tensor) -> dict[str, Tensor]:
    return {"approx_kl": x.mean(-(x.log_probs - x.old_log_probs)), "ratio": x.mean(ratio)}


def _clipped_surrogate(x: _Inputs, ratio: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(-A r, -A clip(r), their max) [b, T]: PPO's pessimistic surrogate."""
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * ratio.clamp(1.0 - x.eps_low, 1.0 + x.eps_high)
    return unclipped, clipped, torch.maximum(unclipped, clipped)


def _clip_stats(x: _Inputs, ratio: Tensor, unclipped: Tensor, clipped: Tensor) -> dict[str, Tensor]:
    active = clipped > unclipped
    return {
        "clip_frac": x.mean(active),
        "clip_frac_low": x.mean(active & (ratio < 1.0 - x.eps_low)),
        "clip_frac_high": x.mean(active & (ratio > 1.0 + x.eps_high)),
    }


def _dual_clipped(x: _Inputs, per_token: Tensor, stats: dict[str, Tensor]) -> Tensor:
    """Dual clip (Ye et al. 2020): the loss of an A < 0 token is capped at -A * c, so a few stale tokens with huge
    ratios cannot dominate the update (A >= 0 is already bounded by the clip)."""
    if x.dual_clip is None:
        return per_token
    cap = -x.advantages * x.dual_clip
    active = (x.advantages < 0) & (per_token > cap)
    stats["dual_clip_frac"] = x.mean(active)
    return torch.where(active, cap, per_token)


def _ppo(x: _Inputs) -> _PerToken:
    ratio = x.log_ratio().exp()
    unclipped, clipped, per_token = _clipped_surrogate(x, ratio)
    stats = {**_clip_stats(x, ratio, unclipped, clipped), **_base_stats(x, ratio)}
    return _PerToken(_dual_clipped(x, per_token, stats), stats)


def _gspo(x: _Inputs) -> _PerToken:
    # Every token takes the sequence's ratio exp(mean log-ratio); OpenRLHF forces the per-sequence mean.
    seq = masked_mean(x.log_probs - x.old_log_probs, x.mask, dim=-1).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = seq.exp().unsqueeze(-1).expand_as(x.log_probs)
    unclipped, clipped, per_token = _clipped_surrogate(x, ratio)
    stats = {**_clip_stats(x, ratio, unclipped, clipped), **_base_stats(x, ratio)}
    return _PerToken(_dual_clipped(x, per_token, stats), stats, agg="seq-mean-token-mean")


# verl's gspo clamps each token's log-ratio at this before exp() (core_algos.compute_policy_loss_gspo)
GSPO_TOKEN_MAX_LOG_RATIO = 10.0


def _gspo_token(x: _Inputs) -> _PerToken:
    # verl's gspo: log s_i,t = log pi_t - sg(log pi_t) + sg(mean_t log-ratio): the value is the sequence's ratio, the
    # gradient each token's own; every token keeps its own advantage. No dual clip (verl's gspo has none).
    seq = masked_mean(x.log_probs - x.old_log_probs, x.mask, dim=-1).detach()
    log_ratio = x.log_probs - x.log_probs.detach() + seq.unsqueeze(-1)
    ratio = log_ratio.clamp(-MAX_LOG_RATIO, GSPO_TOKEN_MAX_LOG_RATIO).exp()
    unclipped, clipped, per_token = _clipped_surrogate(x, ratio)
    stats = {**_clip_stats(x, ratio, unclipped, clipped), **_base_stats(x, ratio)}
    return _PerToken(per_token, stats, agg="seq-mean-token-mean")


def _cispo(x: _Inputs) -> _PerToken:
    ratio = x.log_ratio().exp()
    weight = ratio.clamp(1.0 - x.eps_low, 1.0 + x.eps_high).detach()
    stats = {"clip_frac": x.mean(weight != ratio), **_base_stats(x, ratio)}
    return _PerToken(-weight * x.advantages * x.log_probs, stats)


def _sapo(x: _Inputs) -> _PerToken:
    ratio = x.log_ratio().exp()
    tau = torch.full_like(ratio, x.p.sapo_tau_neg).masked_fill(x.advantages > 0, x.p.sapo_tau_pos)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau  # slope 1 at r = 1: the on-policy gradient is -A d(log pi)
    return _PerToken(-gate * x.advantages, _base_stats(x, ratio), agg="seq-mean-token-mean")


def _gpg(x: _Inputs) -> _PerToken:
    return _PerToken(-x.advantages * x.log_probs, _base_stats(x, x.log_ratio().exp()))


def _valid_flat(x: _Inputs) -> tuple[Tensor, Tensor]:
    """The valid tokens' advantages and detached log-probs, flattened: [n], [n]."""
    return x.advantages[x.mask], x.log_probs.detach()[x.mask]


def _clip_cov(x: _Inputs) -> _PerToken:
    ratio = x.log_ratio().exp()
    unclipped, clipped, per_token = _clipped_surrogate(x, ratio)
    by_clip = (clipped > unclipped) & x.mask
    adv, logp = _valid_flat(x)
    # The covariance of each token's advantage and log-prob around the micro-batch's means (detached: it only
    # selects tokens); tokens the clip already stops are not candidates.
    cov = torch.full_like(x.log_probs, -math.inf).detach()
    if adv.numel():
        cov = (x.advantages - adv.mean()) * (x.log_probs.detach() - logp.mean())
    lb, ub = x.p.clip_cov_bounds
    candidates = (x.mask & ~by_clip & (cov > lb) & (cov < ub)).nonzero()
    keep = torch.ones_like(x.log_probs)
    if len(candidates):
        k = max(int(x.p.clip_cov_ratio * float(x.mask.sum())), 1)
        chosen = candidates[torch.randperm(len(candidates))[:k]]
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
    stats = {
        **_clip_stats(x, ratio, unclipped, clipped),
        "cov_detached_frac": x.mean(keep == 0),
        **_base_stats(x, ratio),
    }
    return _PerToken(per_token * keep, stats)


def _kl_cov(x: _Inputs) -> _PerToken:
    log_ratio = x.log_ratio()
    ratio = log_ratio.exp()
    plain = -x.advantages * ratio
    penalised = plain + x.p.kl_cov_coef * log_ratio.abs()
    adv, logp = _valid_flat(x)
    chosen = torch.zeros_like(x.mask)
    if adv.numel():
        cov = (adv - adv.mean()) * (logp - logp.mean())
        k = max(1, int(adv.numel() * x.p.kl_cov_ratio))
        positions = x.mask.nonzero()[torch.topk(cov, k).indices]
        chosen[positions[:, 0], positions[:, 1]] = True
    stats = {"abs_kl": x.mean(log_ratio.abs()), "cov_penalised_frac": x.mean(chosen), **_base_stats(x, ratio)}
    return _PerToken(torch.where(chosen, penalised, plain), stats)


def _geo_mean(x: _Inputs) -> _PerToken:
    log_ratio = x.log_ratio()
    bounded = log_ratio.clamp(-x.eps_low, x.eps_high)
    sign = torch.sign(x.advantages)
    # Clip in log space in the pessimistic direction only: capped above for A > 0, floored for A < 0.
    chosen = sign * torch.minimum(sign * log_ratio, sign * bounded)
    m = x.mask.to(log_ratio.dtype)
    tokens = m.sum(-1) + 1e-8
    seq_ratio = ((chosen * m).sum(-1) / tokens).exp()
    seq_adv = (x.advantages * m).sum(-1) / tokens
    outside = log_ratio != bounded
    stats = {
        "clip_frac_high": x.mean(outside & (x.advantages > 0)),
        "clip_frac_low": x.mean(outside & (x.advantages < 0)),
        **_base_stats(x, log_ratio.exp()),
    }
    stats["clip_frac"] = stats["clip_frac_high"] + stats["clip_frac_low"]
    return _PerToken(-seq_adv * seq_ratio, stats, rows=True)


def _dppo(x: _Inputs, kl: bool) -> _PerToken:
    ratio = x.log_ratio().exp()
    cap = DPPO_RATIO_CAP if x.dual_clip is None else x.dual_clip
    weight = ratio.clamp(max=cap).detach()
    p, p_old = x.log_probs.detach().exp(), x.old_log_probs.exp()
    if kl:  # the sampled token's Bernoulli KL(old || new), inside the trust region or moved against the advantage
        divergence = (
            p_old * (x.old_log_probs - x.log_probs.detach()) + (1 - p_old) * ((1 - p_old + 1e-8) / (1 - p + 1e-8)).log()
        )
        valid = torch.where(
            x.advantages > 0, (divergence <= x.eps_high) | (p <= p_old), (divergence <= x.eps_low) | (p >= p_old)
        )
    else:  # total variation of the sampled token's probability, one-sided in the advantage's direction
        valid = torch.where(x.advantages > 0, p - p_old <= x.eps_high, p - p_old >= -x.eps_low)
    stats = {
        "clip_frac": x.mean(~valid),
        "ratio_cap_frac": x.mean((ratio > cap) & valid),
        **_base_stats(x, ratio),
    }
    return _PerToken(-x.advantages * weight * x.log_probs * valid.to(ratio.dtype), stats)


def _dro(x: _Inputs) -> _PerToken:
    beta = x.p.dro_beta
    if beta is None or beta <= 0:
        raise ValueError(f"the dro loss needs dro_beta > 0, got {beta}")
    log_ratio = x.log_probs - x.old_log_probs
    return _PerToken(-(x.log_probs * x.advantages - 0.5 * beta * log_ratio**2), _base_stats(x, x.log_ratio().exp()))


_LOSSES: dict[str, Callable[[_Inputs], _PerToken]] = {
    "ppo": _ppo,
    "gspo": _gspo,
    "gspo_token": _gspo_token,
    "cispo": _cispo,
    "sapo": _sapo,
    "gpg": _gpg,
    "clip_cov": _clip_cov,
    "kl_cov": _kl_cov,
    "geo_mean": _geo_mean,
    "dppo_tv": lambda x: _dppo(x, kl=False),
    "dppo_kl": lambda x: _dppo(x, kl=True),
    "dro": _dro,
}


def check_params(loss_type: str, dual_clip: float | None, params: PolicyLossParams) -> str | None:
    """Why these settings cannot run `loss_type` (None: they can), in the loss's own terms."""
    check_choice("policy loss type", loss_type, POLICY_LOSS_TYPES)
    if loss_type in ("ppo", "gspo") and dual_clip is not None and dual_clip <= 1.0:
        return f"dual_clip must be > 1 (the loss is capped at -A*dual_clip), got {dual_clip}"
    if loss_type.startswith("dppo") and dual_clip is not None and dual_clip <= 0:
        return f"{loss_type} truncates the ratio at dual_clip, which must be > 0, got {dual_clip}"
    if loss_type == "sapo" and min(params.sapo_tau_pos, params.sapo_tau_neg) <= 0:
        return f"sapo's temperatures must be > 0, got {params.sapo_tau_pos} and {params.sapo_tau_neg}"
    lb, ub = params.clip_cov_bounds
    if loss_type == "clip_cov" and (params.clip_cov_ratio <= 0 or lb >= ub):
        return f"clip_cov needs clip_cov_ratio > 0 and lb < ub, got {params.clip_cov_ratio} and ({lb}, {ub})"
    if loss_type == "kl_cov" and params.kl_cov_ratio <= 0:
        return f"kl_cov needs kl_cov_ratio > 0, got {params.kl_cov_ratio}"
    if loss_type == "dro" and (params.dro_beta is None or params.dro_beta <= 0):
        return f"the dro loss needs dro_beta > 0, got {params.dro_beta}"
    return None


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
    weights: Tensor | None = None,
    params: PolicyLossParams = PolicyLossParams(),
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss `loss_type` of one micro-batch and its detached, scalar stats.

    log_probs (with gradient), old_log_probs, advantages, mask, weights: [b, T]; old_log_probs, advantages and
    weights are constants. The clip range is [1 - eps_clip, 1 + eps_clip_high] (eps_clip_high None: eps_clip;
    OpenRLHF --eps_clip_low_high, verl clip_ratio_low/high); geo_mean reads the pair as log-space bounds, dppo_tv /
    dppo_kl as trust-region thresholds. dual_clip: ppo and gspo's dual-clip constant (> 1), dppo's ratio cap
    (default 3). weights: rollout-correction weights, multiplied into each token's loss after every clip (geo_mean:
    their per-sequence geometric mean into the sequence's loss). num_tokens / num_seqs: the whole mini-batch's counts
    (rlrun.algo.losses.aggregate_loss); gspo and sapo always aggregate seq-mean-token-mean, geo_mean by sequence.
    Stats (masked means over valid tokens): approx_kl (mean of old - new log-probs) and ratio for every loss;
    clip_frac (the share of tokens the clip or trust region acts on: its meaning per loss is in docs/usage.md) and
    the loss's own (clip_frac_low/high, dual_clip_frac, cov_detached_frac, abs_kl, cov_penalised_frac,
    ratio_cap_frac) where it has them."""
    if (why := check_params(loss_type, dual_clip, params)) is not None:
        raise ValueError(why)
    x = _Inputs(
        log_probs,
        old_log_probs,
        advantages,
        mask.bool(),
        eps_clip,
        eps_clip if eps_clip_high is None else eps_clip_high,
        dual_clip,
        params,
    )
    out = _LOSSES[loss_type](x)
    if out.rows:
        per_row = out.loss
        if weights is not None:  # the sequence's geometric-mean weight (verl's geo_mean)
            m = x.mask.to(per_row.dtype)
            per_row = per_row * ((weights + 1e-10).log() * m).sum(-1).div(m.sum(-1) + 1e-8).exp()
        loss = per_row.sum() / max(float(per_row.numel() if num_seqs is None else num_seqs), 1.0)
    else:
        per_token = out.loss if weights is None else out.loss * weights
        loss = aggregate_loss(per_token, x.mask, out.agg or agg, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, {k: v.detach() for k, v in out.stats.items()}
