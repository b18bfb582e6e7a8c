"""Reading a safetensors file with pread, a tensor (or a slice of its rows) at a time, into fresh tensors.

Why not safetensors' own `safe_open`: it memory-maps the file, and every page a read touches then counts in the
process's resident memory (VmRSS, and its peak VmHWM) until the file is closed. An engine rank that reads a whole
65M-parameter bf16 checkpoint carried its 125 MiB that way, on top of the model it filled, through its start-up; at
70B that is 140 GB of mapped pages per rank. Read with pread, the bytes go through the page cache (shared by the
node's ranks, reclaimable, not counted in any rank's RSS) straight into the tensor the caller keeps or converts.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from math import prod

import torch
from huggingface_hub import split_torch_state_dict_into_shards

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
            for name, meta in header.items()
            if name != "__metadata__"
        }

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
            got = os.preadv(self._fd, [view[done : done + _PREAD_CHUNK]], offset + done)
            if got == 0:
                raise ValueError(f"{self.path}: the file ends before the tensor data its header lists (truncated?)")
            done += got

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        self.close()


# ---- writing -----------------------------------------------------------------------------------------------------
# Writing a model's safetensors files one tensor at a time, in any order, without ever holding the model.
#
# The layout is planned from names, shapes and dtypes alone: the files as transformers' `save_pretrained` splits a
# state dict (huggingface_hub's `split_torch_state_dict_into_shards`, 50 GB per file by default, with
# `model.safetensors.index.json` when there are several), and each file's header with every tensor's byte range. A
# tensor is then written straight to its range as soon as it is known (os.pwrite), so an export that gathers one
# FSDP/ZeRO-3 unit at a time holds one unit, never the model. The files are written under hidden temporary names
# and renamed into place only by `commit`, once every tensor has arrived: an export that stops half-way (NaN
# weights, a full disk, a crash) leaves no file a loader would take for a model.
#
# The format (https://github.com/huggingface/safetensors#format): an 8-byte little-endian header length, a JSON
# header {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}} padded with spaces to a
# multiple of 8 bytes, then the tensors' bytes, contiguous and row-major.

# safetensors' dtype names (the format's own list); a dtype outside it has no streamed export.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
DEFAULT_MAX_SHARD_SIZE = "50GB"  # save_pretrained's default
INDEX_SUFFIX = ".index.json"
_PWRITE_CHUNK = 1 << 30  # bytes per os.pwrite call (Linux writes at most ~2 GiB per call)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class _Place:
    file: str
    offset: int  # bytes from the start of the file
    spec: TensorSpec


class SafetensorsLayout:
    """Where every tensor of `specs` goes: files named by `filename_pattern` ("model{suffix}.safetensors"), split at
    `max_shard_size` as save_pretrained splits, each tensor's byte offset in its file, and the index (None when
    one file holds everything). `total_parameters`: the index's metadata entry of that name, as transformers
    writes it."""

    def __init__(
        self,
        specs: dict[str, TensorSpec],
        *,
        filename_pattern: str = "model{suffix}.safetensors",
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        metadata: dict[str, str] | None = None,
        total_parameters: int | None = None,
    ) -> None:
        for name, spec in specs.items():
            if spec.dtype not in DTYPE_NAMES:
                raise ValueError(
                    f"{name}: dtype {spec.dtype} has no safetensors name; streamed exports write "
                    f"{sorted(DTYPE_NAMES.values())}"
                )
        self.name = filename_pattern.format(suffix="")
        meta = {n: torch.empty(s.shape, dtype=s.dtype, device="meta") for n, s in specs.items()}
        split = split_torch_state_dict_into_shards(
            meta, filename_pattern=filename_pattern, max_shard_size=max_shard_size
        )
        self.files: dict[str, bytes] = {}  # file -> its header, length prefix and padding included
        self.places: dict[str, _Place] = {}
        for file, names in split.filename_to_tensors.items():
            header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
            begin = 0
            for name in names:
                spec = specs[name]
                header[name] = {
                    "dtype": DTYPE_NAMES[spec.dtype],
                    "shape": list(spec.shape),
                    "data_offsets": [begin, begin + spec.nbytes],
                }
                begin += spec.nbytes
            text = json.dumps(header, separators=(",", ":")).encode()
            text += b" " * (-len(text) % 8)  # the tensors' bytes start 8-byte aligned, as safetensors writes them
            self.files[file] = struct.pack("<Q", len(text)) + text
            for name in names:
                data_begin = header[name]["data_offsets"][0]  # type: ignore[index]
                self.places[name] = _Place(file, len(self.files[file]) + data_begin, specs[name])
        self.index: dict[str, object] | None = None
        if split.is_sharded:
            extra = {} if total_parameters is None else {"total_parameters": total_parameters}
            self.index = {"metadata": {**extra, **split.metadata}, "weight_map": split.tensor_to_filename}

    @property
    def total_bytes(self) -> int:
        return sum(p.spec.nbytes for p in self.places.values()) + sum(len(h) for h in self.files.values())


class StreamedSafetensors:
    """A layout's files being written into `directory`: `write` any tensor in any order, then `commit` (or
    `abort`). Not thread-safe; one writer process."""

    def __init__(self, layout: SafetensorsLayout, directory: str) -> None:
        self.layout = layout
        self.directory = directory
        self._written: set[str] = set()
        self._fds: dict[str, int] = {}
        try:
            for file, header in layout.files.items():
                fd = self._fds[file] = os.open(self._partial(file), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                _pwrite_all(fd, memoryview(header), 0)
        except BaseException:
            self.abort()
            raise

    def _partial(self, file: str) -> str:
        return os.path.join(
            self.directory, f".{file}.partial"
        )  # hidden: no loader, nor save_pretrained's clean-up, reads it

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write tensor `name` (its planned shape and dtype) to its place."""
        place = self.layout.places[name]
        if tuple(tensor.shape) != place.spec.shape or tensor.dtype != place.spec.dtype:
            raise ValueError(
                f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the layout planned "
                f"{place.spec.shape} {place.spec.dtype}"
            )
        data = tensor.detach().to("cpu").contiguous()
        _pwrite_all(self._fds[place.file], host_bytes(data), place.offset)
        self._written.add(name)

    def commit(self) -> list[str]:
        """Every tensor written: flush, rename the files into place, write the index (or remove a stale one), and
        remove the other layout's stale file (one model.safetensors beside new shards would be loaded instead of
        them). Returns the files written."""
        missing = self.layout.places.keys() - self._written
        if missing:
            self.abort()
            raise RuntimeError(f"streamed export: {len(missing)} tensors never written, e.g. {sorted(missing)[:3]}")
        for fd in self._fds.values():
            os.fsync(fd)
            os.close(fd)
        self._fds.clear()
        for file in self.layout.files:
            os.replace(self._partial(file), os.path.join(self.directory, file))
        single = os.path.join(self.directory, self.layout.name)
        index = single + INDEX_SUFFIX
        if self.layout.index is not None:
            with open(index, "w", encoding="utf-8") as f:
                f.write(json.dumps(self.layout.index, indent=2, sort_keys=True) + "\n")
            stale = [single]
        else:
            stale = [index]
        stem = re.escape(self.layout.name.removesuffix(".safetensors"))
        shard = re.compile(stem + r"-\d{5}-of-\d{5}\.safetensors")
        stale += [
            os.path.join(self.directory, f)
            for f in os.listdir(self.directory)
            if shard.fullmatch(f) and f not in self.layout.files
        ]
        for path in stale:
            if os.path.isfile(path):
                os.remove(path)
        return list(self.layout.files)

    def abort(self) -> None:
        """Close and remove the temporary files."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for file in self.layout.files:
            try:
                os.remove(self._partial(file))
            except FileNotFoundError:
                pass


def host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of `t` (contiguous, on the CPU), borrowed while `t` lives. Not through `.numpy()`: that marks the
    storage non-resizable for good, and a tensor written here may be a parameter's own storage (DeepSpeed ZeRO-0-2,
    a one-rank FSDP mesh), which --sleep frees by resizing it to 0 bytes."""
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    data = data.cast("B")
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done : done + _PWRITE_CHUNK], offset + done)


# ---- tensors for a file ------------------------------------------------------------------------------------------
# Tensors ready for a safetensors file (shared by the HF export and the vLLM weight push).


def unshared(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, none overlapping the memory of another (safetensors refuses overlapping tensors, e.g. tied
    weights). Disjoint views of one storage (WeightSync's bucket views) are kept as they are: safetensors (>= 0.3.2)
    writes those without complaint, and cloning them would copy whole buckets."""
    kept: dict[tuple[torch.device, int], list[tuple[int, int]]] = {}  # storage -> byte ranges already in `out`
    out = {}
    for name, t in named:
        t = t.detach().contiguous()
        key = (t.device, t.untyped_storage().data_ptr())
        start = t.storage_offset() * t.element_size()
        end = start + t.numel() * t.element_size()
        ranges = kept.setdefault(key, [])
        if end > start and any(start < e and s < end for s, e in ranges):
            t = t.clone()
            key, start, end = (t.device, t.untyped_storage().data_ptr()), 0, t.numel() * t.element_size()
            ranges = kept.setdefault(key, [])
        ranges.append((start, end))  # type: ignore[arg-type]  # ints (SymInt: traced tensors only)
        out[name] = t
    return out
