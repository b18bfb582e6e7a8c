"""Per-token log-probabilities and entropy, the loss aggregation modes and the clipped value loss.

Stateless tensor functions. The policy surrogates are in rlrun.algo.policy_losses; advantages, returns and KL
estimators in rlrun.algo.algorithms. Nothing here runs a collective: global token / sequence counts for
aggregation are passed in.

Shape conventions: ``B``/``b`` rows (a batch / a micro-batch), ``T`` response positions,
``V`` vocab. Masks are 0/1 (any dtype) with 1 on response tokens. Semantics follow
OpenRLHF (openrlhf/models/utils.py, openrlhf/models/loss.py) and verl core_algos.py.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

from rlrun.algo.algorithms import check_choice, masked_mean

LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


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
