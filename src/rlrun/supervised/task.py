"""What a supervised trainer (SFT, reward model, DPO) plugs into the shared loop (rlrun.supervised.loop)."""

from __future__ import annotations

from collections import defaultdict
from typing import Generic, Protocol, TypeVar

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from rlrun.strategies.base import Strategy

S = TypeVar("S")
S_contra = TypeVar("S_contra", contravariant=True)


class Tally:
    """Sums over the samples a rank has seen since the last `take()`; summed over ranks by the loop, so every
    logged metric is exact over the global batch whatever the ranks and micro-batches."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)

    def add(self, **values: float | torch.Tensor) -> None:
        for key, value in values.items():
            self.sums[key] += float(value)

    def take(self) -> dict[str, float]:
        out, self.sums = dict(self.sums), defaultdict(float)
        return out


class Task(Protocol, Generic[S_contra]):
    """One trainer's model(s) and loss. `model` is the trained (wrapped) model, stepped by the loop's Updater."""

    name: str  # "sft" | "rm" | "dpo": log and tracker names
    tally_keys: tuple[str, ...]  # every key `tally` may hold (a rank with no samples still sums zeros)
    model: nn.Module
    optimizer: torch.optim.Optimizer
    strategy: Strategy
    tally: Tally

    def loss_tokens(self, sample: S_contra) -> int:
        """Tokens of `sample` a token-mean loss averages over (>= 1)."""
        ...

    def micro_loss(self, samples: list[S_contra], num_tokens: float, num_seqs: float) -> torch.Tensor:
        """The micro-batch's share of the global batch loss (normalised by the batch's tokens or samples per
        rank, see rlrun.roles.update); records its metric sums in `tally`."""
        ...

    def score(self, samples: list[S_contra]) -> None:
        """Evaluation: record the metric sums of `samples` in `tally` (no gradient)."""
        ...

    def summary(self, sums: dict[str, float], *, evaluation: bool) -> dict[str, float]:
        """Metrics from tallies summed over every rank (of a training step, or of an evaluation pass)."""
        ...

    def save(self, path: str, tokenizer: PreTrainedTokenizerBase, *, is_writer: bool, allow_nonfinite: bool = False,
             merged: bool = False) -> None:
        """The trained model in HF format (collective over the ranks); with LoRA the adapter directory, and with
        `merged` (--save_merged) the merged model in <path>/merged too."""
        ...
