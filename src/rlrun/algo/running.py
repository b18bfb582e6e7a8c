"""Running mean/std of scores for --running_reward_norm (state saved with checkpoints)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RunningMoments:
    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0  # sum of squared deviations (Chan et al. parallel update)

    def update(self, x: torch.Tensor) -> None:
        """Fold a batch [B] into the running statistics."""
        n = float(x.numel())
        if n == 0:
            return
        batch_mean = float(x.double().mean())
        batch_m2 = float(((x.double() - batch_mean) ** 2).sum())
        delta = batch_mean - self.mean
        total = self.count + n
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return (self.m2 / self.count) ** 0.5 if self.count > 1 else 1.0

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / (self.std + 1e-8)
