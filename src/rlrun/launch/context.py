"""What every component of one rank shares, built once after the process groups exist (rlrun.rl.assembly, the
supervised assembly): the layout, the groups, the compute device, the run's seed, the tokenizer and the phase
tracker. Components take this context and their own config section (torchtitan's Configurable.build), never the
whole config and never a long list of the same few values."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from rlrun.launch.groups import Groups
from rlrun.launch.layout import Layout
from rlrun.runtime.phases import PhaseTracker


@dataclass(frozen=True)
class RankContext:
    """One rank's shared context. `device`: where its models compute (collectives take tensors there too: NCCL needs
    them on the GPU, gloo stages them through host memory)."""

    layout: Layout
    groups: Groups
    device: torch.device
    seed: int  # --seed: every random draw derives from it (rlrun.data.batching.derive_seed)
    phase: PhaseTracker
    tokenizer: PreTrainedTokenizerBase

    @property
    def rank(self) -> int:
        return self.groups.rank
