"""Handing an engine rank's memory to its vLLM child process without copying it (no vLLM here).

The parent sends the child, once, the storages of WeightSync's two staging buffers (engines/vllm/stream.py) and
where each tensor lies in them; the child rebuilds the same views over the same memory. Each weight sync then writes
a bucket into a buffer, tells the child, and writes that buffer again only after the child acked that it copied the
bucket out. A buffer that moved to other memory is sent again (`memory_key`).

- CPU: each storage is moved into shared memory in place (the tensors over it, WeightSync's buffers, follow it) and
  crosses the pipe as a file descriptor (torch.multiprocessing's default file_descriptor strategy: the segments
  are made with shm_open and unlinked at once, but their bytes still count against /dev/shm; check_shm says so
  before they are made, instead of a SIGBUS when a write touches a page /dev/shm cannot hold).
- CUDA: each storage crosses as a CUDA IPC handle (torch.multiprocessing.reductions.reduce_tensor), rebuilt in the
  child on the GPU with the same UUID: the child sees its GPUs under other indices (its own CUDA_VISIBLE_DEVICES).
  Nothing is copied and nothing goes through /dev/shm (but torch's small IPC reference-count file).
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from rlrun.runtime.errors import RlrunError

SHM_DIR = "/dev/shm"
# Where rebuild_cuda_tensor takes the device index (the parent's index; the child's differs).
_DEVICE_ARG = list(inspect.signature(rebuild_cuda_tensor).parameters).index("storage_device")


class SharedMemoryError(RlrunError):
    """Too little free space on /dev/shm (or the directory weights are written to) for a vLLM weight hand-off."""


# ---- /dev/shm space --------------------------------------------------------------------------------------------


def free_bytes(path: str = SHM_DIR) -> int | None:
    """Free bytes for an unprivileged writer on the filesystem holding `path` (None: no such directory)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_shm(needed: int, what: str, path: str = SHM_DIR) -> None:
    """SharedMemoryError (one line: bytes needed and free, and the fix) when `path`'s filesystem cannot take
    `needed` more bytes. No check where `path` does not exist (shared memory lives elsewhere there)."""
    free = free_bytes(path)
    if free is None or needed <= free:
        return
    if path.startswith(SHM_DIR):
        size = max(1, math.ceil(needed * 1.25 / 2**30))  # a quarter more, for vLLM's own segments and the rest
        fix = (
            f"give the container more shared memory (docker run --shm-size={size}g, or --ipc=host; Kubernetes: a "
            f"memory-backed emptyDir mounted at {SHM_DIR}), or use a smaller model"
        )
    else:
        fix = "free space there, or use a smaller model"
    raise SharedMemoryError(
        f"{what} needs {needed} bytes ({_gib(needed)}) in {path}, but only {free} bytes ({_gib(free)}) are free: {fix}"
    )


# ---- storages --------------------------------------------------------------------------------------------------


def _key(t: torch.Tensor) -> tuple[torch.device, int]:
    return t.device, t.untyped_storage().data_ptr()


def distinct_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The storages holding `tensors`, each once (bucket views share one)."""
    seen: dict[tuple[torch.device, int], torch.UntypedStorage] = {}
    for t in tensors:
        seen.setdefault(_key(t), t.untyped_storage())
    return list(seen.values())


def unshared_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the CPU storages of `tensors` not yet in shared memory: what handing them over adds to /dev/shm."""
    return sum(s.nbytes() for s in distinct_storages(tensors) if s.device.type == "cpu" and not s.is_shared())


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of `tensors` themselves (meta tensors included: the size they will have)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def file_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """About the size of a safetensors file holding `tensors` (data plus a generous header)."""
    tensors = list(tensors)
    return tensor_bytes(tensors) + 256 * len(tensors) + 2**16


# ---- the hand-off ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class View:
    """Where one parameter lies in a sent storage (offset and stride in elements of dtype)."""

    name: str
    storage: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class Handoff:
    """What crosses the pipe: per storage, a uint8 tensor over it in shared memory (CPU; torch.multiprocessing turns
    it into a file descriptor) or reduce_tensor's arguments of one (CUDA: an IPC handle); per parameter, its View."""

    views: tuple[View, ...]
    storages: tuple[Any, ...]
    gpu_uuid: str | None = None  # CUDA: the GPU holding the storages


def memory_key(named: Sequence[tuple[str, torch.Tensor]]) -> tuple:
    """Changes whenever a parameter moves to other memory (a hand-off must be sent again)."""
    return tuple((n, *_key(t), t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset()) for n, t in named)


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def pack(named: Sequence[tuple[str, torch.Tensor]]) -> Handoff:
    """The hand-off of `named` (all on one device), each storage once. CPU: moves the storages into shared memory
    first, in place (callers check /dev/shm with unshared_bytes before)."""
    tensors = [t.detach() for _, t in named]
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"the weights to hand over lie on several devices: {sorted(map(str, devices))}")
    device = devices.pop() if devices else torch.device("cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"weights on {device} cannot be handed to another process (CPU or CUDA only)")
    storages = distinct_storages(tensors)
    index = {(device, s.data_ptr()): i for i, s in enumerate(storages)}
    views = tuple(
        View(n, index[_key(t)], t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())  # type: ignore[arg-type]  # an int (SymInt: traced tensors only)
        for (n, _), t in zip(named, tensors)
    )
    whole = [torch.empty(0, dtype=torch.uint8, device=device).set_(s) for s in storages]
    if device.type == "cpu":
        for w in whole:
            w.share_memory_()  # in place: no-op when already shared
        return Handoff(views, tuple(whole))
    return Handoff(views, tuple(tuple(reduce_tensor(w)[1]) for w in whole), gpu_uuid(device))


def _cuda_index(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise RlrunError(
        f"the GPU holding the engine's weights (UUID {uuid}) is not visible to the vLLM child "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})"
    )


def unpack(handoff: Handoff) -> list[tuple[str, torch.Tensor]]:
    """In the receiving process: (name, tensor) over the sender's memory, no copy."""
    if handoff.gpu_uuid is None:
        buffers = list(handoff.storages)
    else:
        index = _cuda_index(handoff.gpu_uuid)
        buffers = []
        for args in handoff.storages:
            args = list(args)
            args[_DEVICE_ARG] = index
            buffers.append(rebuild_cuda_tensor(*args))
    out = []
    for v in handoff.views:
        buf = buffers[v.storage]
        t = torch.empty(0, dtype=v.dtype, device=buf.device).set_(buf.untyped_storage(), v.offset, v.shape, v.stride)
        out.append((v.name, t))
    return out
