"""Reading a safetensors file with pread, a tensor (or a slice of its rows) at a time, into fresh tensors.

Why not safetensors' own `safe_open`: it memory-maps the file, and every page a read touches then counts in the
process's resident memory (VmRSS, and its peak VmHWM) until the file is closed. An engine rank that reads a whole
65M-parameter bf16 checkpoint carried its 125 MiB that way, on top of the model it filled, through its start-up; at
70B that is 140 GB of mapped pages per rank. Read with pread, the bytes go through the page cache (shared by the
node's ranks, reclaimable, not counted in any rank's RSS) straight into the tensor the caller keeps or converts.
"""

from __future__ import annotations

import json
import os
from math import prod

import torch

from rlrun.models.safetensors_stream import DTYPE_NAMES, host_bytes

_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
_PREAD_CHUNK = 1 << 30  # bytes per os.preadv call (Linux reads at most ~2 GiB per call)


class SafetensorsReader:
    """One safetensors file: its header read once, tensors read on demand."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1
        self._fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self._fd).st_size
        length = int.from_bytes(os.pread(self._fd, 8, 0), "little") if size >= 8 else -1
        if not 0 < length <= size - 8:
            self.close()
            raise ValueError(f"{path}: not a safetensors file (header length {length}, file size {size} bytes)")
        header = json.loads(os.pread(self._fd, length, 8))
        self._base = 8 + length
        self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {
            name: (meta["dtype"], tuple(meta["shape"]), *meta["data_offsets"])
            for name, meta in header.items() if name != "__metadata__"}

    def knows_every_dtype(self) -> bool:
        """Whether every tensor of the file has a dtype this reader knows (else: safetensors' own reader)."""
        return all(kind in _DTYPES for kind, _, _, _ in self._entries.values())

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or its rows [start, stop) along dim 0, in its stored dtype: a new tensor of its own."""
        kind, shape, begin, end = self._entries[name]
        dtype = _DTYPES[kind]
        if rows is not None:
            if not shape:
                raise ValueError(f"{self.path}: {name} is 0-dimensional; it has no rows to slice")
            start, stop = max(0, rows[0]), min(shape[0], rows[1])
            stop = max(start, stop)
            row_bytes = prod(shape[1:]) * dtype.itemsize
            begin, shape = begin + start * row_bytes, (stop - start, *shape[1:])
            end = begin + (stop - start) * row_bytes
        out = torch.empty(shape, dtype=dtype)
        if end > begin:
            self._read_into(host_bytes(out), self._base + begin)
        return out

    def _read_into(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:done + _PREAD_CHUNK]], offset + done)
            if got == 0:
                raise ValueError(f"{self.path}: the file ends before the tensor data its header lists (truncated?)")
            done += got

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()
