"""Forward passes shared by the roles: response log-probs and per-token values."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from rlrun.algorithms import entropy_from_logits, log_probs_from_logits
from rlrun.models import position_ids_from
from rlrun.rollout import RolloutBatch


def response_log_probs(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int,
                       temperature: float, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, L] -> log-probs of the last `response_width` tokens [b, R] (and their entropy [b, R]).

    Logits are divided by the sampling temperature so the ratio is taken against the policy
    that actually sampled the tokens."""
    out = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask))
    logits = out.logits[:, -response_width - 1:-1, :].float()
    logp = log_probs_from_logits(logits, sequences[:, -response_width:], temperature)
    entropy = entropy_from_logits(logits / temperature) if with_entropy else None
    return logp, entropy


def response_values(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                    response_width: int) -> torch.Tensor:
    """[b, L] -> value of the state before each response token [b, R]."""
    return model(sequences, attention_mask)[:, -response_width - 1:-1]


def last_token_scores(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                      response_len: torch.Tensor, response_width: int) -> torch.Tensor:
    """[b, L] -> the scalar head at each row's last real token [b]."""
    values = model(sequences, attention_mask)
    last = sequences.shape[1] - response_width + response_len - 1
    return values.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1)


def micro_batches(num_rows: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, num_rows)) for i in range(0, num_rows, size)]


@torch.no_grad()
def over_micro_batches(model: nn.Module, batch: RolloutBatch, micro_batch: int, device: torch.device,
                       fn: Callable[[RolloutBatch], torch.Tensor]) -> torch.Tensor:
    """Inference in micro-batches: fn(part on device) -> [b, ...]; results concatenated on CPU."""
    model.eval()
    out = [fn(batch.rows(rows).to(device)).float().cpu() for rows in micro_batches(batch.sequences.shape[0], micro_batch)]
    return torch.cat(out)
