"""Full parameters of a DeepSpeed ZeRO-3 model, gathered over its role's group (part of the DeepSpeed adapter:
only `deepspeed_adapter.py`, `deepspeed_state.py` and this module import deepspeed).

Under ZeRO-3 every partitioned parameter is an empty placeholder outside a forward pass (`p.ds_shape` is its
real shape, `p.ds_tensor` this rank's flat slice). Weight sync and exports read full tensors block by block
through `GatheredParameters`, so at most one transformer block is whole at a time on top of the partitions;
writes go through `GatheredParameters(modifier_rank=0)`, which re-partitions what the first rank holds.
Every function here is collective over the role (the parameters' partition group): every rank of the role
calls it, with the same model, in the same order.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

import deepspeed  # noqa: E402  (an optional extra; rlrun.strategies.checks refuses --strategy deepspeed without it)

from rlrun.launch.param_blocks import FullBlock
from rlrun.models.weights import Unfilled


def fill_partitioned(unfilled: Unfilled, group: "dist.ProcessGroup", device: torch.device, dtype: torch.dtype,
                     config: dict, mpu: object) -> nn.Module:
    """A meta-device model partitioned one parameter at a time, as `deepspeed.zero.Init` partitions a model built
    inside it: the role's first rank reads a parameter whole, ZeRO's init broadcasts it over the role's group and
    every rank keeps its partition before the next parameter exists. No rank ever holds more than the partitions
    plus one whole parameter. `deepspeed.initialize` then finds the parameters partitioned and leaves them."""
    first: list[nn.Parameter] = []

    def partition(param: nn.Parameter) -> None:
        if first:
            first[0].convert_to_zero_parameters(param_list=[param])
            return
        holder = nn.Module()
        holder.register_parameter("p", param)
        deepspeed.zero.Init(module=holder, data_parallel_group=group, config_dict_or_path=config, dtype=dtype,
                            mpu=mpu)
        first.append(param)

    return unfilled.fill_each(device, dtype, partition, read=dist.get_rank(group) == 0)


def is_partitioned(p: torch.Tensor) -> bool:
    """True for a ZeRO-3 parameter (whether or not it is persistent, i.e. kept whole on every rank)."""
    return hasattr(p, "ds_id")


def full_shape(p: torch.Tensor) -> torch.Size:
    return p.ds_shape if is_partitioned(p) else p.shape


def layer_groups(model: nn.Module) -> list[list[tuple[str, nn.Parameter]]]:
    """The model's parameters in `named_parameters` order, one group per transformer block (the classes named
    in any submodule's `_no_split_modules`, as FSDP2 wraps them; a value head's wrapper has none of its own)
    and one for everything outside the blocks, placed first."""
    block_names = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or [])}
    prefixes = [name for name, m in model.named_modules() if type(m).__name__ in block_names]
    groups: dict[str | None, list[tuple[str, nn.Parameter]]] = {None: [], **{p: [] for p in prefixes}}
    for name, p in model.named_parameters():
        owners = [pre for pre in prefixes if name.startswith(pre + ".")]
        groups[max(owners, key=len) if owners else None].append((name, p))
    return [named for named in groups.values() if named]


class Zero3Block:
    """One group of ZeRO-3 parameters; `gather()` makes them whole for a moment and copies them out (the
    same role as rlrun.launch.param_blocks.ParamBlock). Collective over the role."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        self.named = named

    def shapes(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        return [(n, full_shape(p), p.dtype) for n, p in self.named]

    @torch.no_grad()
    def gather(self, scratch: object = None) -> FullBlock:
        """`scratch` is accepted for the ParamBlock surface and unused: DeepSpeed gathers into its own buffers."""
        params = [p for _, p in self.named]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            plain = {n: p.detach().clone() for n, p in self.named}
        meta = {n: (t.shape, t.dtype) for n, t in plain.items()}
        return FullBlock(list(plain), meta, plain, [], {})


def blocks(model: nn.Module) -> list[Zero3Block]:
    return [Zero3Block(named) for named in layer_groups(model)]


def full_tensors(model: nn.Module, keep: bool) -> dict[str, torch.Tensor]:
    """{name: full CPU tensor} of every parameter and buffer (the model's state_dict names, tied weights under
    each of their names); `keep=False` ranks take part in the gathers and return {}."""
    by_id: dict[int, torch.Tensor] = {}
    for block in blocks(model):
        params = [p for _, p in block.named]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if keep:
                for p in params:
                    by_id[id(p)] = p.detach().to("cpu", copy=True)
    if not keep:
        return {}
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for name, value in model.state_dict(keep_vars=True).items():
        out[name] = by_id[id(params[name])] if name in params else value.detach().to("cpu", copy=True)
    return out


def write_full(named: Iterable[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Set each parameter to its full value (the same on every rank), re-partitioned. Collective over the role."""
    pairs = list(named)
    with torch.no_grad(), deepspeed.zero.GatheredParameters([p for p, _ in pairs], modifier_rank=0):
        for p, value in pairs:
            p.copy_(value.to(p.device, p.dtype))


def grouped(model: nn.Module, values: dict[str, torch.Tensor]) -> Iterator[list[tuple[nn.Parameter, torch.Tensor]]]:
    """(parameter, value) pairs of `values` (by parameter name), one list per layer group."""
    for named in layer_groups(model):
        pairs = [(p, values[n]) for n, p in named if n in values]
        if pairs:
            yield pairs
