"""Tensors ready for a safetensors file (shared by the HF export and the vLLM weight push)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def unshared(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, none sharing memory with another (safetensors refuses shared storage, e.g. tied weights)."""
    seen: set[int] = set()
    out = {}
    for name, t in named:
        t = t.detach().contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out
