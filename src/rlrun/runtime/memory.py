"""This process's own memory, as the kernel counts it (Linux /proc; None elsewhere), and the tensor bytes a piece of
code holds at once (LiveTensorBytes: what benches and tests measure a device's working set with on CPU)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rlrun.runtime.log import RankLogger

REPORT_ENV = "RLRUN_REPORT_MEMORY"  # set to 1: every rank logs its peak RSS after start-up and at the end


def peak_rss_bytes() -> int | None:
    """VmHWM: the largest resident set this process has had (its peak host memory, file-backed pages included)."""
    return _status_bytes("VmHWM:")


def rss_bytes() -> int | None:
    """VmRSS: this process's resident set now."""
    return _status_bytes("VmRSS:")


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reporting() -> bool:
    return os.environ.get(REPORT_ENV) == "1"


def _cuda_allocator_peak() -> int | None:
    """The CUDA allocator's peak since its last reset, when this process uses a GPU; else None."""
    torch = sys.modules.get("torch")  # never imported here: runtime/ stays importable without torch
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.max_memory_allocated())


def _reset_cuda_allocator_peak() -> None:
    sys.modules["torch"].cuda.reset_peak_memory_stats()


def _reset_peak_rss() -> None:
    """Set VmHWM back to the current RSS (Linux >= 4.0: proc(5), /proc/pid/clear_refs, value 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


class _PhasePeaks:
    """A peak (host RSS, or the CUDA allocator's) within each loop phase (generate, score, train, sync; over all
    steps), for checking the memory plan phase by phase: the peak is reset where a phase starts, after folding it
    into every phase still open (phases nest) and into the whole run's peak, which `report_memory` keeps reporting.
    Only with RLRUN_REPORT_MEMORY=1."""

    def __init__(self, read: Callable[[], int | None], reset: Callable[[], None]) -> None:
        self.peaks: dict[str, int] = {}
        self.overall = 0
        self._open: list[str] = []
        self._read, self._reset = read, reset

    def _fold(self, peak: int) -> None:
        self.overall = max(self.overall, peak)
        for name in self._open:
            self.peaks[name] = max(self.peaks.get(name, 0), peak)

    def enter(self, phase: str) -> None:
        peak = self._read() if _reporting() else None
        if peak is None:
            return
        self._fold(peak)
        self._reset()
        self._open.append(phase)

    def exit(self, phase: str) -> None:
        peak = self._read() if _reporting() else None
        if peak is None or phase not in self._open:
            return
        self._fold(peak)
        self._open.remove(phase)

    def whole_run(self) -> int | None:
        peak = self._read()
        return None if peak is None else max(self.overall, peak)

    def text(self, what: str) -> str:
        """'<what> N MiB (generate a, score b, ... MiB)', or '' without a peak."""
        peak = self.whole_run()
        if peak is None:
            return ""
        phases = ", ".join(f"{name} {b / 2**20:.0f}" for name, b in self.peaks.items())
        return f"{what} {peak / 2**20:.0f} MiB" + (f" ({phases} MiB)" if phases else "")


def phase_peaks_mib(listed: str) -> dict[str, int]:
    """What `_PhasePeaks.text` lists in its parentheses ("generate 651, score 699, train 717"), read back: phase ->
    MiB (bench/memory.py and bench/gpu/harness.py read the memory lines)."""
    return {name: int(mib) for name, mib in (part.rsplit(" ", 1) for part in listed.split(", "))}


class _EveryPeak:
    """The phase hooks of the run loop (rlrun.runtime.phases.PhaseTracker): host RSS and the GPU allocator's."""

    def __init__(self) -> None:
        self.host = _PhasePeaks(peak_rss_bytes, _reset_peak_rss)
        self.gpu = _PhasePeaks(_cuda_allocator_peak, _reset_cuda_allocator_peak)

    def enter(self, phase: str) -> None:
        self.host.enter(phase)
        self.gpu.enter(phase)

    def exit(self, phase: str) -> None:
        self.gpu.exit(phase)
        self.host.exit(phase)


PHASE_PEAKS = _EveryPeak()


def report_memory(log: RankLogger, phase: str) -> None:
    """With RLRUN_REPORT_MEMORY=1, one line per rank: its peak RSS so far, and on a GPU the CUDA allocator's peak,
    each overall and per loop phase (bench/memory.py and bench/gpu/harness.py read these lines)."""
    host = PHASE_PEAKS.host.text(f"peak RSS after {phase}") if _reporting() else ""
    if not host:  # not asked for, or no /proc
        return
    gpu = PHASE_PEAKS.gpu.text("peak GPU allocated")
    log._emit("info", f"memory: rank {log.rank} {host}" + (f", {gpu}" if gpu else ""))


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 2**18


# While decoding: glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), and the trim
# threshold its dynamic rule pairs with it (twice that); after: the fixed threshold and glibc's default trim threshold.
DECODE_MMAP_THRESHOLD_BYTES = 32 * 2**20
DECODE_TRIM_THRESHOLD_BYTES = 64 * 2**20
TRIM_THRESHOLD_BYTES = 128 * 2**10
_M_TRIM_THRESHOLD = -1


class _Heap:
    """glibc's malloc, once return_freed_memory fixed its threshold (None: not applied, or not glibc)."""

    libc: ctypes.CDLL | None = None
    reusing = 0  # how many reuse_heap blocks are open (nested, or an async loop's thread beside the main one)
    lock = threading.Lock()


def return_freed_memory() -> bool:
    """Have glibc serve every allocation of 256 KiB or more by its own mmap, so that freeing it returns it to the
    system.

    By default glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), after which
    blocks of that size come from the heap, where freed memory stays resident: a ZeRO-3 rank that gathers and frees
    one transformer block at a time then keeps growing (measured, 65M-parameter model on 8 CPU ranks: actor ranks
    peaked at 1.5 GiB instead of 0.79 GiB). A fixed threshold turns the dynamic raise off. 256 KiB rather than 1 MiB:
    a block's unsharded k/v projections, their gradients and a micro-batch's larger activations (0.25-1 MiB each on
    that model) then leave no holes in the heap between the long-lived shards either (actor ranks' peak -25 to -35
    MiB; no step-time difference measured over 4 alternating pairs, bench/README.md). Decoding is the exception:
    see `reuse_heap`. The user's own MALLOC_MMAP_THRESHOLD_ wins; no effect off glibc. Returns whether the setting
    was applied."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        applied = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    _Heap.libc = libc if applied else None
    return applied


@contextmanager
def reuse_heap() -> Iterator[None]:
    """Within: blocks up to 32 MiB come from the heap again and its top is kept, as glibc's defaults would; after,
    the heap is trimmed (malloc_trim: its free pages go back to the system). A decode step allocates and frees the
    same mid-sized tensors (logits, attention scores, MLP activations) every token; served by mmap, or by a heap top
    trimmed after each free, each is fresh memory whose pages fault in again. Measured on the native engine (64 rows
    x 64 tokens of the 3m preset, 2 CPU threads, medians of 4 fresh processes): glibc's defaults 0.44 s, the fixed
    threshold 0.48 s, within this block 0.42 s. No effect unless return_freed_memory applied its threshold."""
    libc = _Heap.libc
    if libc is None:
        yield
        return
    with _Heap.lock:
        _Heap.reusing += 1
        libc.mallopt(_M_MMAP_THRESHOLD, DECODE_MMAP_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, DECODE_TRIM_THRESHOLD_BYTES)
    try:
        yield
    finally:
        with _Heap.lock:
            _Heap.reusing -= 1
            if _Heap.reusing == 0:
                libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
                libc.malloc_trim(0)


class LiveTensorBytes(TorchDispatchMode):
    """While active: the peak of the bytes of op outputs alive at once (each new storage counts until the tensor that
    brought it is freed; views and in-place results bring none). What a caching allocator's max_memory_allocated
    would see of the code run inside, tensors made before it left out."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view or an in-place result: memory that existed before
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                try:
                    storage = t.untyped_storage()
                    key, size = storage.data_ptr(), storage.nbytes()
                except RuntimeError:  # a storage the op left without memory (FSDP2 frees its unsharded ones)
                    continue
                if size and key not in self.seen:
                    self.seen.add(key)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(t, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self.seen.discard(key)
