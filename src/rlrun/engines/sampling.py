"""Token sampling with the log-probability of each sampled token: HF's temperature and top-p warpers, then a draw
from a caller-owned generator (reproducible from a seed without touching the global RNG)."""

from __future__ import annotations

import torch

from rlrun.runtime.errors import NonFiniteError


def processed_log_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """logits [B, V] -> log-probabilities [B, V] of the sampling distribution: logits / temperature, then (top_p < 1)
    only the smallest set of tokens whose probability reaches top_p (HF's TopPLogitsWarper: sorted ascending, drop
    tokens whose cumulative probability is <= 1 - top_p, always keep the most likely one), renormalised.
    vLLM calls these the processed log-probs."""
    scores = logits.float() / temperature
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - top_p)
        drop_sorted[:, -1] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scores, dim=-1)


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B] long, their log-probabilities [B] fp32 under the processed distribution)."""
    log_probs = processed_log_probs(logits, temperature, top_p)
    try:
        tokens = torch.multinomial(log_probs.exp(), 1, generator=generator)
    except RuntimeError as exc:
        if "probability tensor contains" not in str(exc):
            raise
        raise NonFiniteError("the policy's next-token probabilities are NaN/inf: its weights are no longer finite "
                             "(the run diverged; lower the learning rate, and resume from the last checkpoint)") from None
    return tokens[:, 0], log_probs.gather(1, tokens)[:, 0]
