"""The surface every training strategy offers (FSDP2 in `fsdp.py`, DeepSpeed in `deepspeed.py`).

A strategy owns how ONE role's model is placed over that role's process group: wrapping, the optimizer
step, full parameters for weight sync, full/sharded state for saving. Every collective it issues is on
the role's group; nothing here touches the world group.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from rlrun.models.weights import Unfilled
from rlrun.runtime.errors import CheckpointError
from rlrun.strategies.blocks import ParamBlock, ParamHoming

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


class SleepUnit(enum.Enum):
    """What of a role's model sleeps and wakes separately (--sleep)."""

    PARAMS = "parameters"  # weights and buffers: all a forward pass or a weight sync reads
    STATES = "optimizer states"  # gradients, optimizer state, fp32 master weights: only training needs them


ALL_UNITS = frozenset(SleepUnit)


class GradClipper(Protocol):
    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float: ...


class StepOps(Protocol):
    """How the update loop (roles/update.py) runs one optimizer step over a role's micro-batches."""

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None: ...

    def backward(self, loss: torch.Tensor, *, last_micro: bool) -> None:
        """Accumulate `loss`'s gradient unscaled (the loss already carries rlrun's global token/sequence
        weighting); `last_micro` marks the final micro-batch before the step."""
        ...

    def clip_and_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, clipper: GradClipper, max_norm: float
    ) -> float:
        """Clip to `max_norm` (<= 0: no clipping) and step. Returns the gradient norm before clipping; when
        it is not finite the weights are left untouched and the gradients dropped."""
        ...


class TorchSteps:
    """Plain autograd + a torch optimizer: single-process models and FSDP2 (which reduces in backward)."""

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor, *, last_micro: bool) -> None:
        loss.backward()

    def clip_and_step(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, clipper: GradClipper, max_norm: float
    ) -> float:
        grad_norm = clipper.clip_grad_norm(model, max_norm)
        if math.isfinite(grad_norm):
            optimizer.step()
        else:  # a NaN/inf gradient must never reach the weights
            optimizer.zero_grad(set_to_none=True)
        return grad_norm


class Strategy(GradClipper, ParamHoming, Protocol):
    """One role's sharding engine. `wrap`/`wrap_trainable` are called once per model; the others are
    collective over the role's group where they say so (every rank of the role must call them)."""

    group: torch.distributed.ProcessGroup

    def release_gathered(self, model: nn.Module) -> None:
        """After a no-grad forward of a trainable model: drop the full parameters it left gathered, so that the
        module holds its shards again (what the optimizer steps and a reset writes) and the next forward gathers."""
        ...

    def wrap(self, model: nn.Module | Unfilled, *, trainable: bool = True) -> nn.Module:
        """A frozen (trainable=False) model ready for forward passes on this role's ranks. An `Unfilled` model is
        placed first and filled after: a rank reads only what it keeps."""
        ...

    def wrap_trainable(
        self, model: nn.Module | Unfilled, make_optimizer: OptimizerFactory
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """(model to call forward on, the torch optimizer whose param_groups an LR scheduler drives)."""
        ...

    def step_ops(self, model: nn.Module) -> StepOps: ...

    def param_blocks(self, model: nn.Module) -> list[ParamBlock]:
        """The parameters in gather order, grouped so each block is one collective (weight sync)."""
        ...

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Full CPU tensors under the model's own (HF) names on the role's first rank, {} elsewhere.
        Collective over the role."""
        ...

    def export_view(self, model: nn.Module) -> AbstractContextManager[tuple[nn.Module, list[ParamBlock]]]:
        """(the model as the user built it, whose names the blocks use; its parameters in blocks), with the
        parameters awake meanwhile: `shapes()` gives each block's full shapes without a collective, and each
        `gather()` is collective over the role (every rank gathers every block, in order). An export streams
        through these one block at a time instead of holding `full_state_dict`."""
        ...

    def save_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        """Model + optimizer state into directory `path`, world-size independent. Collective over the role."""
        ...

    def load_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        """Inverse of save_state, on any number of role ranks. Collective over the role."""
        ...

    # Sleep (--sleep): local to this rank, never collective. save_state, load_state and
    # full_state_dict wake a sleeping model for their duration; forward passes and weight sync need it awake.

    def sleep(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, parts: frozenset[SleepUnit] = ALL_UNITS
    ) -> int:
        """Move `parts` of `model` (and of its optimizer; None for a frozen model) off the compute device, freeing
        their device memory. Returns the bytes moved (0 for parts already asleep)."""
        ...

    def wake(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, parts: frozenset[SleepUnit] = ALL_UNITS
    ) -> int:
        """Inverse of sleep: the same tensors hold the same bytes on the compute device again. Returns the bytes
        moved."""
        ...

    def asleep(self, model: nn.Module) -> frozenset[SleepUnit]:
        """The parts of `model` asleep now."""
        ...


@dataclass(frozen=True)
class ModelState:
    """A role's model and optimizer as a part of a checkpoint (rlrun.checkpoint.checkpointer.Part): its strategy writes
    them into <checkpoint>/<folder>, sharded and world-size independent, and reads them back on any number of the
    role's ranks. Collective over the role. `missing`: what a checkpoint without the folder is told (the run needs
    it), or "" to let the strategy's load fail."""

    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer
    folder: str
    missing: str = ""

    def save(self, path: str) -> None:
        self.strategy.save_state(self.model, self.optimizer, os.path.join(path, self.folder))

    def load(self, path: str) -> None:
        where = os.path.join(path, self.folder)
        if self.missing and not os.path.isdir(where):
            raise CheckpointError(f"{path} has no {self.folder} state, {self.missing}")
        self.strategy.load_state(self.model, self.optimizer, where)
