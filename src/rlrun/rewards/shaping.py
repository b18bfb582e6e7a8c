"""Reward shaping applied to sequence scores before the advantages (OpenRLHF 0.11 semantics):
DAPO's overlong penalty, ProRL's stop-properly penalty, and DAPO's dynamic filtering of prompt groups.

Pure tensor functions; shapes in each docstring ([B] = one value per sequence).
"""

from __future__ import annotations

import torch
from torch import Tensor


def overlong_penalty(response_len: Tensor, max_new_tokens: int, buffer_len: int,
                     penalty_factor: float) -> Tensor:
    """DAPO overlong penalty to ADD to each sequence's reward: [B] lengths -> [B].

    A response longer than max_new_tokens - buffer_len loses
    min(len - (max_new_tokens - buffer_len), buffer_len) / buffer_len * penalty_factor,
    i.e. a linear ramp from 0 to -penalty_factor over the last buffer_len tokens
    (OpenRLHF length_penalty.py, apply_overlong_penalty). Shorter responses get 0.
    """
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(f"overlong buffer_len must be in (0, max_new_tokens={max_new_tokens}], got {buffer_len}")
    exceed = (response_len.to(torch.float64) - (max_new_tokens - buffer_len)).clamp(max=float(buffer_len))
    return torch.where(exceed > 0, -exceed / buffer_len * penalty_factor, 0.0)


def stop_properly_penalty(rewards: Tensor, truncated: Tensor, coef: float) -> Tensor:
    """ProRL penalty for responses cut off by the length limit: [B], [B] bool -> [B].

    coef in [0, 1] scales a truncated response's reward by coef; coef < 0 replaces it by
    coef (OpenRLHF length_penalty.py, apply_stop_properly_penalty). Others are unchanged.
    """
    if coef > 1:
        raise ValueError(f"stop_properly_penalty_coef must be in [0, 1] or negative, got {coef}")
    penalised = torch.full_like(rewards, coef) if coef < 0 else rewards * coef
    return torch.where(truncated.bool(), penalised, rewards)


def truncated_rows(responses: Tensor, response_len: Tensor, max_new_tokens: int, eos_token_id: int) -> Tensor:
    """Which responses were cut off by the length limit: [B, r] ids, [B] lengths -> [B] bool.

    responses are right-padded response ids (EOS kept). A response is truncated when it
    reached max_new_tokens and its last token is not EOS: vLLM's finish_reason == "length",
    which OpenRLHF's stop-properly penalty reads.
    """
    last = responses.gather(1, (response_len.long() - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
    return cut_by_length(last, response_len, max_new_tokens, eos_token_id)


def cut_by_length(last_token: Tensor, response_len: Tensor, max_new_tokens: int, eos_token_id: int) -> Tensor:
    """The truncation rule itself: [B] last response token, [B] lengths -> [B] bool (reached the limit, no EOS)."""
    return (response_len >= max_new_tokens) & (last_token != eos_token_id)


def dynamic_filter_keep(scores: Tensor, n_samples_per_prompt: int,
                        reward_range: tuple[float, float]) -> Tensor:
    """Which rows survive DAPO dynamic filtering: [B] scores -> [B] bool.

    A prompt group (n consecutive rows) is kept when low < mean(scores of the group) < high,
    strictly, as OpenRLHF's samples_generator does: with 0/1 rewards and the default range
    (0, 1) this drops the groups that are all wrong or all right (zero group advantage).
    """
    n = n_samples_per_prompt
    if scores.dim() != 1 or scores.numel() % n:
        raise ValueError(f"scores must be [B] with B divisible by n_samples_per_prompt={n}, "
                         f"got shape {tuple(scores.shape)}")
    low, high = reward_range
    group_mean = (scores if scores.is_floating_point() else scores.float()).reshape(-1, n).mean(-1)
    keep = (group_mean > low) & (group_mean < high)
    return keep.repeat_interleave(n)
