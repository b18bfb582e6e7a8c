"""rlrun.models.safetensors against safetensors' own reader, on files safetensors itself writes: every dtype, row
slices, 0-dim and empty tensors; damaged files get a clear error; and reading leaves no file pages in this process's
resident memory (the reason it exists: safe_open's memory map keeps them there)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rlrun.models.safetensors import SafetensorsReader


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssFile:"))


def test_every_tensor_and_row_slice_reads_as_safetensors_reads_it(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "f32": torch.randn(7, 5, generator=g), "bf16": torch.randn(4, 3, 2, generator=g).to(torch.bfloat16),
        "f16": torch.randn(9, generator=g).half(), "i64": torch.arange(-6, 6).view(3, 4),
        "bool": torch.rand(5, 2, generator=g) > 0.5, "u8": torch.arange(10, dtype=torch.uint8),
        "f8": torch.randn(3, 4, generator=g).to(torch.float8_e4m3fn), "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
    }
    path = str(tmp_path / "model.safetensors")
    save_file(state, path, metadata={"format": "pt"})
    reader = SafetensorsReader(path)
    assert reader.knows_every_dtype() and sorted(reader.keys()) == sorted(state)
    with safe_open(path, framework="pt") as ref:
        for name in state:
            assert reader.shape(name) == tuple(ref.get_slice(name).get_shape())
            got, want = reader.read(name), ref.get_tensor(name)
            assert _same_bytes(got, want), name
            if want.dim() == 0:
                with pytest.raises(ValueError, match="0-dimensional"):
                    reader.read(name, (0, 1))
                continue
            for rows in ((0, 1), (1, 3), (2, 100), (5, 5), (0, want.shape[0])):
                assert _same_bytes(reader.read(name, rows), ref.get_slice(name)[rows[0]:rows[1]]), (name, rows)
    reader.close()


def test_damaged_files_are_refused_with_the_path(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64, 64)}, str(path))
    whole = path.read_bytes()
    path.write_bytes(whole[:-100])  # truncated inside the data
    with pytest.raises(ValueError, match="ends before"):
        SafetensorsReader(str(path)).read("w")
    path.write_bytes(b"\xff" * 16)  # a header length past the end of the file
    with pytest.raises(ValueError, match="not a safetensors file"):
        SafetensorsReader(str(path))


def test_reading_a_whole_file_leaves_its_pages_out_of_the_resident_set(tmp_path):
    """32 MiB read through safe_open's map stay resident (RssFile) while it is open; read here, they do not."""
    path = str(tmp_path / "model.safetensors")
    save_file({f"w{i}": torch.randn(1024, 1024) for i in range(8)}, path)
    size_kib = os.path.getsize(path) // 1024
    reader = SafetensorsReader(path)
    before = _rss_file_kib()
    tensors = [reader.read(name) for name in reader.keys()]
    mine = _rss_file_kib() - before
    with safe_open(path, framework="pt") as ref:
        before = _rss_file_kib()
        mapped = [ref.get_tensor(name).sum() for name in ref.keys()]
        theirs = _rss_file_kib() - before
    assert len(tensors) == len(mapped) == 8
    assert theirs > size_kib // 2  # the measurement sees mapped pages
    assert mine < size_kib // 16
