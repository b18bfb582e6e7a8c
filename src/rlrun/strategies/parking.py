"""Sleep's mechanism, shared by both strategies: park tensor storages off the compute device, restore them in place.

Parking works on storages, not tensors: each distinct storage on the compute device is copied to host memory
(pinned on CUDA) and then resized to 0 bytes; waking resizes it back and copies the bytes in. Every tensor
object, view and alias keeps its identity, so whatever holds on to them (FSDP2's padded shards and their
DTensor views, DeepSpeed's flat buffers and the parameter views into them, an optimizer's state keyed by
parameter, tied weights) is valid again after waking, bit for bit. This is how FSDP2 itself frees its
gathered parameters. Nothing here is collective.

A tensor whose storage is parked must not be read: torch does not check, and a kernel on a 0-byte storage
crashes the process. So while a part is asleep, its model refuses forward passes and its optimizer refuses
steps (RlrunError), and the strategies check before gathering weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from rlrun.runtime.errors import RlrunError
from rlrun.strategies.base import SleepUnit


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that owns memory on this rank (a DTensor's local shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def device_storages(tensors: Iterable[torch.Tensor], device: torch.device) -> dict[int, torch.UntypedStorage]:
    """The distinct, non-empty storages of `tensors` that live on `device`, by data pointer."""
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        t = local(t)
        if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
            continue
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            out.setdefault(storage.data_ptr(), storage)
    return out


def held_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes the distinct storages of `tensors` hold on `device` (shared storages counted once)."""
    return sum(s.nbytes() for s in device_storages(tensors, device).values())


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage (its nbytes elements)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class ParkedStorages:
    """Storages copied to host memory and freed on their device (see the module docstring)."""

    def __init__(self, storages: Iterable[torch.UntypedStorage], device: torch.device) -> None:
        self.device = device
        self._parked: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        pin = device.type == "cuda"
        with torch.no_grad():
            for storage in storages:
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
                host.copy_(_bytes_view(storage), non_blocking=pin)
                self._parked.append((storage, host))
            if pin:
                torch.cuda.synchronize(device)  # the copies must be complete before their sources are freed
            for storage, _ in self._parked:
                storage.resize_(0)
        if pin:
            # hand the memory back to the driver: a vLLM child process allocates outside torch's cache
            torch.cuda.empty_cache()
        self.nbytes = sum(host.numel() for _, host in self._parked)

    def restore(self) -> None:
        pin = self.device.type == "cuda"
        with torch.no_grad():
            for storage, host in self._parked:
                storage.resize_(host.numel())
                _bytes_view(storage).copy_(host, non_blocking=pin)
            if pin:
                torch.cuda.synchronize(self.device)  # before the pinned host buffers are released
        self._parked = []


@dataclass
class _Asleep:
    parked: ParkedStorages
    guard: RemovableHandle | None


@dataclass
class SleepBook:
    """What one strategy has parked, per model and part, with the guards that make a sleeping model fail loudly."""

    device: torch.device
    _asleep: dict[tuple[int, SleepUnit], _Asleep] = field(default_factory=dict)

    def asleep(self, model: nn.Module) -> frozenset[SleepUnit]:
        return frozenset(part for part in SleepUnit if (id(model), part) in self._asleep)

    def sleep(
        self,
        model: nn.Module,
        part: SleepUnit,
        tensors: Iterable[torch.Tensor],
        keep: Iterable[torch.Tensor],
        guarded: nn.Module,
        optimizer: torch.optim.Optimizer | None,
    ) -> int:
        """Park the storages of `tensors` (those of `keep`, the model's other part, stay). Returns the bytes parked.
        `guarded`: the module whose forward must refuse to run while PARAMS sleep; `optimizer`: refuses to step
        while STATES sleep."""
        key = (id(model), part)
        if key in self._asleep:
            return 0
        kept = device_storages(keep, self.device)
        storages = [s for ptr, s in device_storages(tensors, self.device).items() if ptr not in kept]
        parked = ParkedStorages(storages, self.device)
        guard = None
        if part is SleepUnit.PARAMS:
            guard = guarded.register_forward_pre_hook(
                _refuse("a forward pass ran on a model whose parameters are asleep"), prepend=True
            )  # before FSDP2's own hook reads the shards
        elif optimizer is not None:
            guard = optimizer.register_step_pre_hook(
                _refuse("an optimizer step ran on a model whose optimizer state is asleep")
            )
        self._asleep[key] = _Asleep(parked, guard)
        return parked.nbytes

    def wake(self, model: nn.Module, part: SleepUnit) -> int:
        entry = self._asleep.pop((id(model), part), None)
        if entry is None:
            return 0
        if entry.guard is not None:
            entry.guard.remove()
        entry.parked.restore()
        return entry.parked.nbytes

    def require_awake(self, model: nn.Module, part: SleepUnit, what: str) -> None:
        if (id(model), part) in self._asleep:
            raise RlrunError(
                f"{what} needs the model's {part.value}, which are asleep (--sleep); "
                "the sleep schedule (rlrun.rl.sleep) must wake them first"
            )


def _refuse(what: str):
    def hook(*_: object) -> None:
        raise RlrunError(f"{what} (--sleep); the sleep schedule (rlrun.rl.sleep) must wake it first")

    return hook


class SleepCapable(Protocol):
    """The three methods awake_meanwhile needs (both strategies have them)."""

    def asleep(self, model: nn.Module) -> frozenset[SleepUnit]: ...

    def sleep(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, parts: frozenset[SleepUnit]) -> int: ...

    def wake(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, parts: frozenset[SleepUnit]) -> int: ...


@contextlib.contextmanager
def awake_meanwhile(
    sleeper: SleepCapable,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    parts: frozenset[SleepUnit] = frozenset(SleepUnit),
) -> Iterator[None]:
    """Wake what of `parts` sleeps in `model`, and put it back to sleep afterwards (checkpoints and exports read a
    model whatever the schedule). STATES need the `optimizer` to find its state again."""
    parts = sleeper.asleep(model) & parts
    if parts:
        sleeper.wake(model, optimizer, parts)
    try:
        yield
    finally:
        if parts:
            sleeper.sleep(model, optimizer, parts)
