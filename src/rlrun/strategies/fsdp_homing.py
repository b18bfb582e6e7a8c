"""FSDP2 parameters that live in memory the caller owns: weight sync's send buckets (zero-copy send).

An actor on ONE rank holds every parameter whole (FSDP2 shards over a one-rank mesh). When those shards ARE the
byte buckets the weight sync broadcasts, the sync's root sends them as they are, with no packing copy: the
difference between ~1.5x and ~1.0x of one raw broadcast (bench/weight_sync.py). This module re-points the shards;
it reaches into FSDP2's per-parameter record (`FSDPParam`: its flat shard, which FSDP's all-gathers read), so
it checks that record's form first and declines (a reason, never an error) when this torch lays it out
differently, or when the parameters are sharded over several ranks, offloaded, or in another dtype.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard


def _fsdp_params_by_param(model: nn.Module) -> dict[int, object]:
    """id(sharded parameter) -> FSDP2's FSDPParam that manages it (torch-internal objects; {} when this torch
    lays them out differently)."""
    out: dict[int, object] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()  # type: ignore[operator]
            group = getattr(state, "_fsdp_param_group", None)
            for fsdp_param in getattr(group, "fsdp_params", None) or []:
                out[id(getattr(fsdp_param, "sharded_param", None))] = fsdp_param
    return out


def _param_blocker(name: str, p: torch.Tensor, fsdp_param: object | None, has_units: bool,
                   dtype: torch.dtype, device: torch.device) -> str | None:
    if p.dtype != dtype:
        return f"{name} is {p.dtype}, the engines take {dtype} (the send casts)"
    if isinstance(p, DTensor):
        if not tuple(p.placements) == (Shard(0),) or p.device_mesh.size() != 1:
            return f"{name} is sharded over {p.device_mesh.size()} ranks (the root gathers it)"
        if fsdp_param is None or type(getattr(fsdp_param, "_sharded_param_data", None)) is not torch.Tensor \
                or getattr(fsdp_param, "offload_to_cpu", True):
            return f"{name}: FSDP2 keeps its shard in a form this rlrun cannot re-home (CPU offload or a new torch)"
        local_tensor = p.to_local()
    elif has_units:
        return f"{name} is gathered by FSDP right now (after a no-grad forward); it holds a copy"
    else:
        local_tensor = p
    if local_tensor.device != device and not (local_tensor.device.type == device.type and device.index is None):
        return f"{name} is on {local_tensor.device}, the send buckets on {device}"
    return None


def zero_copy_blocker(model: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why `home_params` cannot make every parameter of `model` live in caller-owned buffers of `dtype` on
    `device` (None: it can). It can when each parameter is this rank's whole tensor already: an FSDP2 shard over
    a one-rank mesh (an actor on one rank) or a plain parameter of a model without FSDP, in that dtype."""
    by_param = _fsdp_params_by_param(model)
    has_units = any(isinstance(m, FSDPModule) for m in model.modules())
    for name, p in model.named_parameters():
        reason = _param_blocker(name, p, by_param.get(id(p)), has_units, dtype, device)
        if reason is not None:
            return reason
    return None


@torch.no_grad()
def home_params(model: nn.Module, views: Mapping[str, torch.Tensor]) -> None:
    """Make the named parameters' storage the given views (same shape and dtype, contiguous): each view takes the
    parameter's value, then the parameter -- and for FSDP2 its flat shard record, which its all-gathers read --
    point into the view. Parameter objects keep their identity (optimizer state, hooks). Why: weight sync's root
    then sends its buckets as they are, with no packing copy. The caller checked `zero_copy_blocker` first."""
    by_param = _fsdp_params_by_param(model)
    params = dict(model.named_parameters())
    for name, view in views.items():
        p = params[name]
        if tuple(view.shape) != tuple(p.shape) or view.dtype != p.dtype or not view.is_contiguous():
            raise ValueError(f"{name}: cannot home a {tuple(p.shape)} {p.dtype} parameter in a "
                             f"{tuple(view.shape)} {view.dtype} view")
        if isinstance(p, DTensor):
            fsdp_param = by_param[id(p)]
            view.copy_(p.to_local())
            p._local_tensor = view  # type: ignore[attr-defined]
            fsdp_param._sharded_param_data = view.view(-1)  # type: ignore[attr-defined]
        else:
            view.copy_(p)
            p.data = view
