"""The native engine's random draws, one per (row, token) and independent of how rows are batched.

A shared generator hands out numbers in the order the rows ask for them, so a row's tokens would depend on which rows
decode beside it: on the KV budget, which on a GPU follows the memory free at the call. Each draw here is instead a
hash of (seed, the prompt's index in the call, the token's position in its response): same seed, same prompts, same
samples whatever the budget, the batches or continuous batching's admissions (vLLM seeds each request for the same
reason). The token is then the inverse of the sampling distribution's cumulative sum at that draw, in float64.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
# The 32-bit integer hash of https://stackoverflow.com/a/12996028 (two multiply-xorshift rounds, full avalanche):
# kept in int64 with every product below 2**59, so no operation overflows on any device.
_MULTIPLIER = 0x45D9F3B
_GOLDEN = 0x9E3779B9  # decorrelates the second word of a draw from the first


def _mix(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> hashed int64 values in [0, 2**32)."""
    x = (((x >> 16) ^ x) * _MULTIPLIER) & _M32
    x = (((x >> 16) ^ x) * _MULTIPLIER) & _M32
    return (x >> 16) ^ x


def uniform(seed: int, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """rows [B] long (each row's prompt index in the call), steps [B] long (the token's index in its response) ->
    [B] float64 draws in [0, 1) with 53 random bits, a function of (seed, row, step) alone."""
    folded = (seed ^ (seed >> 32)) & _M32
    key = _mix(_mix(torch.full_like(rows, folded)) ^ (rows & _M32))
    high = _mix(key ^ (steps & _M32))
    low = _mix(high ^ _GOLDEN)
    return ((high >> 11) * 2**32 + low).double() / 2.0**53


def draw_tokens(probs: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """probs [B, V] (non-negative, each row summing to about 1), draws [B] in [0, 1) -> tokens [B] long: the first
    token whose cumulative probability exceeds draw x the row's total, so a token of probability 0 is never drawn.
    A row whose probabilities are not finite gets some token; the caller checks `finite(probs)`."""
    cumulative = probs.double().cumsum(dim=-1)
    target = draws * cumulative[:, -1]
    tokens = torch.searchsorted(cumulative, target[:, None], right=True)[:, 0]
    return tokens.clamp_(max=probs.shape[-1] - 1)
