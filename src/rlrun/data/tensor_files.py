"""Tensors ready for a safetensors file (shared by the HF export and the vLLM weight push)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


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
        ranges.append((start, end))
        out[name] = t
    return out
