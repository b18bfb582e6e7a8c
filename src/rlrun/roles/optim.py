"""Optimizer and warmup + cosine LR schedule for the trainable roles."""

from __future__ import annotations

import math

import torch
from torch import nn


def make_optimizer(model: nn.Module, lr: float, betas: tuple[float, float], weight_decay: float) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)


def warmup_cosine(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float,
                  min_lr_ratio: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ceil(ratio * total) steps, then cosine decay to min_lr_ratio * lr."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
