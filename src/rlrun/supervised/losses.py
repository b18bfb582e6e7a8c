"""Loss maths of rlrun.sft, rlrun.rm and rlrun.dpo, as OpenRLHF 0.11.2 computes it (openrlhf/models/loss.py,
openrlhf/trainer/{sft,rm,dpo}_trainer.py).

Every function returns PER-SAMPLE terms, not a batch mean: the trainer sums the terms of a
micro-batch and divides by a GLOBAL count (response tokens of the whole optimizer step for SFT,
pairs of the whole optimizer step for RM and DPO), so that gradient accumulation and data
parallelism give exactly the full-batch gradient. Nothing here runs a collective.

Shapes: ``B`` samples (SFT sequences, or preference pairs), ``R`` log-prob positions. A mask is
0/1 (any dtype), 1 where a position's log-prob counts; ``log_probs[b, t]`` is the log-prob of the
token the mask's position ``t`` stands for (the caller aligns them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

RMLossKind = Literal["sigmoid", "logexpsigmoid"]
RM_LOSS_KINDS: tuple[str, ...] = get_args(RMLossKind)


def _check_pairs(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 1 or any(s != first for s in shapes.values()):
        raise ValueError(f"expected equal [B] tensors, got shapes {shapes}")


def _check_tokens(log_probs: Tensor, mask: Tensor) -> None:
    if log_probs.dim() != 2 or log_probs.shape != mask.shape:
        raise ValueError(
            f"expected log_probs and mask of one [B, R] shape, got {tuple(log_probs.shape)} and {tuple(mask.shape)}"
        )


def sequence_log_prob(log_probs: Tensor, mask: Tensor) -> Tensor:
    """[B, R], [B, R] -> [B]: the summed log-prob of each sequence's masked tokens.

    DPO's policy and reference inputs (OpenRLHF ``DPOTrainer._get_batch_logps``, the ``sum`` it
    returns: the prompt masked out, response tokens and the appended EOS in, padding out)."""
    _check_tokens(log_probs, mask)
    return (log_probs * mask.to(log_probs.dtype)).sum(-1)


def token_nll(log_probs: Tensor, mask: Tensor) -> Tensor:
    """[B, R], [B, R] -> [B]: each sequence's SUM of -log p over its masked tokens (SFT).

    OpenRLHF 0.11.2's SFT loss (``SFTLoss`` -> ``aggregate_loss``, token-level mode, fed by
    ``iter_grad_accum_global_norm``) is ``sum(-log p * mask)`` over one optimizer step's
    micro-batches and data-parallel ranks divided by that step's global count of masked tokens.
    The trainer reproduces it as ``token_nll(...).sum() / global_masked_tokens`` per micro-batch,
    the counts taken over the whole optimizer step."""
    _check_tokens(log_probs, mask)
    return -(log_probs * mask.to(log_probs.dtype)).sum(-1)


@dataclass(frozen=True)
class DPOTerms:
    """Per-pair DPO terms, each [B]."""

    losses: Tensor  # the per-pair loss, differentiable, NOT averaged (the trainer divides by the global pair count)
    chosen_rewards: Tensor  # beta * (policy_chosen - ref_chosen), detached
    rejected_rewards: Tensor  # beta * (policy_rejected - ref_rejected), detached


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float,
    label_smoothing: float,
    ipo: bool,
) -> DPOTerms:
    """[B] x 4 -> DPOTerms: OpenRLHF's ``DPOLoss`` before its ``.mean()``.

    Inputs are each sequence's summed response log-prob (``sequence_log_prob``) under the policy
    and the frozen reference. With ``h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)``:

    - DPO / cDPO: ``-(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)``,
      ``eps = label_smoothing`` (0: the original DPO loss).
    - IPO (``ipo=True``): ``(h - 1 / (2 * beta)) ** 2``; label_smoothing plays no part, as in OpenRLHF.

    The implicit rewards are ``beta * (policy - ref)`` per response, without gradient. OpenRLHF
    logs their micro-batch means as ``chosen_reward`` / ``reject_reward`` and
    ``mean(chosen_rewards > rejected_rewards)`` (strictly greater) as ``acc``.
    """
    _check_pairs(
        policy_chosen=policy_chosen, policy_rejected=policy_rejected, ref_chosen=ref_chosen, ref_rejected=ref_rejected
    )
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if ipo:
        losses = (h - 1 / (2 * beta)) ** 2  # Eq. 17 of arXiv:2310.12036
    else:
        losses = -F.logsigmoid(beta * h) * (1 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return DPOTerms(losses, chosen_rewards, rejected_rewards)


def nll_term(log_probs: Tensor, mask: Tensor) -> Tensor:
    """[B, R], [B, R] -> [B]: each CHOSEN response's mean -log p per token (DPO's ``--nll_loss_coef`` term).

    Pass the policy's log-probs of the chosen sequences and their response mask (the same mask
    as for ``sequence_log_prob``: prompt out, response tokens and EOS in, padding out).

    OpenRLHF 0.11.2 (``DPOTrainer.concatenated_forward``) computes, per micro-batch,
    ``nll = -mean_over_pairs(sum(log p * mask) / sum(mask))`` over the chosen responses, i.e. the
    mean over pairs of each response's PER-TOKEN-AVERAGED NLL (a per-sequence average; not a token
    mean over all chosen tokens: a long response's tokens weigh less than a short one's). The
    micro-batch loss is ``mean_over_pairs(dpo_losses) + nll_loss_coef * nll``, the NLL part added
    only when ``nll_loss_coef > 1e-8``; ``nll`` (without the coefficient) is logged as
    ``nll_loss`` and the logged ``loss`` excludes it.

    Both parts are micro-batch means in OpenRLHF; DeepSpeed then averages the gradient over the
    accumulated micro-batches and the data-parallel ranks. OpenRLHF's training loader drops the
    incomplete last batch, so every micro-batch holds ``micro_batch_size`` pairs and that average
    of means IS the mean over the optimizer step's ``train_batch_size`` pairs. rlrun divides
    ``(dpo_loss(...).losses + nll_loss_coef * nll_term(...)).sum()`` by the global pair count
    instead, which is that same full-batch mean; it would differ from OpenRLHF's weighting only
    with micro-batches of unequal size, which OpenRLHF never trains on.

    One deliberate difference: a response with no masked token gives 0 here where OpenRLHF's
    ``0 / 0`` gives NaN (OpenRLHF's data always has at least the EOS token, so it never happens there).
    """
    _check_tokens(log_probs, mask)
    m = mask.to(log_probs.dtype)
    return -(log_probs * m).sum(-1) / m.sum(-1).clamp(min=1)


def pairwise_rm_loss(chosen: Tensor, rejected: Tensor, *, kind: RMLossKind, margin: Tensor | None = None) -> Tensor:
    """[B], [B] (rewards of each pair's chosen and rejected sequence) -> [B] per-pair loss.

    - ``sigmoid`` (OpenRLHF ``PairWiseLoss``): ``-log sigmoid(chosen - rejected - margin)``,
      without the margin term when ``margin`` is None.
    - ``logexpsigmoid`` (OpenRLHF ``LogExpLoss``): ``log(1 + exp(rejected - chosen))``. OpenRLHF's
      LogExpLoss takes a margin and ignores it; so does this, to give OpenRLHF's numbers.

    The two are the same function of ``chosen - rejected`` without margin (``log(1 + exp(-x)) =
    -log sigmoid(x)``); ``softplus`` computes it without the overflow of a literal ``exp`` (OpenRLHF's
    literal form gives inf for ``rejected - chosen`` above ~88 in fp32; the value is otherwise equal).
    OpenRLHF averages over the micro-batch; the trainer divides the sum by the global pair count.
    """
    _check_pairs(chosen=chosen, rejected=rejected)
    if kind == "sigmoid":
        diff = chosen - rejected
        if margin is not None:
            _check_pairs(chosen=chosen, margin=margin)
            diff = diff - margin
        return -F.logsigmoid(diff)
    if kind == "logexpsigmoid":
        return F.softplus(rejected - chosen)
    raise ValueError(f"unknown reward-model loss {kind!r}; use one of {list(RM_LOSS_KINDS)}")


def pair_accuracy(chosen: Tensor, rejected: Tensor) -> Tensor:
    """[B], [B] -> [B] float: 1 where chosen > rejected (strictly), OpenRLHF's ``acc`` per pair (RM and DPO)."""
    _check_pairs(chosen=chosen, rejected=rejected)
    return (chosen > rejected).to(torch.float32)
