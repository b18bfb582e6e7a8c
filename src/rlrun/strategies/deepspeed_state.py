"""A DeepSpeed engine's training state by parameter name, saved and loaded with torch DCP (part of the DeepSpeed
adapter: only `deepspeed_adapter.py`, `deepspeed_zero3.py` and this module import deepspeed).

rlrun never calls `engine.save_checkpoint`/`load_checkpoint` (hard-coded world barriers, `latest` written only
by global rank 0; ../shared/DEEPSPEED.md): a checkpoint is the full fp32 master weights and Adam moments,
gathered over the role's group (`safe_get_full_*`, which serve ZeRO-1/2 fragments and ZeRO-3 partitions
alike), plus step and learning rate, so it loads on any role size and any ZeRO stage.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402  (optional extra)
from deepspeed.utils import (lazy_init_hp_params_optimizer_state, safe_get_full_fp32_param,
                             safe_get_full_optimizer_state, safe_set_full_fp32_param, safe_set_full_optimizer_state)

from rlrun.runtime.errors import RlrunError
from rlrun.strategies import deepspeed_zero3 as zero3

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def save_engine_state(engine: DeepSpeedEngine, optimizer: torch.optim.Optimizer, path: str,
                      group: dist.ProcessGroup) -> None:
    """Full fp32 master weights + Adam moments + step + learning rate, by parameter name, into a DCP
    directory (each tensor is whole on every rank; DCP de-duplicates them, so each is written once).
    Collective over `group`: the gathers run per parameter in named_parameters order on every rank.
    Memory: three fp32 copies of the model on CPU per rank."""
    # The learning rate lives in the param groups: LR schedulers restore their counters, not the value they set.
    meta = {"step": torch.tensor(_adam_step(optimizer), dtype=torch.float64),
            "lr": torch.tensor([g["lr"] for g in optimizer.param_groups], dtype=torch.float64)}
    state: dict[str, Any] = {"model": {}, "optim": {}, "meta": meta}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        state["model"][name] = _full_fp32(engine, p).cpu()
        state["optim"][name] = {key: _full_moment(engine, optimizer, p, key).cpu() for key in ADAM_MOMENTS}
    dcp.save(state, checkpoint_id=path, process_group=group)


def load_engine_state(engine: DeepSpeedEngine, optimizer: torch.optim.Optimizer, path: str,
                      group: dist.ProcessGroup) -> None:
    """Read what save_engine_state wrote (any role size, any stage) into the engine: master weights, the
    model's own (possibly bf16) weights, Adam moments, step and learning rate. Collective over `group`."""
    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    state = {"model": {n: torch.empty(zero3.full_shape(p), dtype=torch.float32) for n, p in named},
             "optim": {n: {key: torch.empty(zero3.full_shape(p), dtype=torch.float32) for key in ADAM_MOMENTS}
                       for n, p in named},
             "meta": {"step": torch.zeros((), dtype=torch.float64),
                      "lr": torch.zeros(len(optimizer.param_groups), dtype=torch.float64)}}
    dcp.load(state, checkpoint_id=path, process_group=group)
    _materialize_adam_state(engine, optimizer)
    step = float(state["meta"]["step"])
    with torch.no_grad():
        for name, p in named:
            full = state["model"][name]
            if zero3.is_partitioned(p):  # this rank's fp32 partition and moments; the bf16 partition below
                _set_zero3_partition(p, full, None)
                for key in ADAM_MOMENTS:
                    _set_zero3_partition(p, state["optim"][name][key], key)
            elif hasattr(p, "_hp_mapping"):  # ZeRO-1/2: this rank's fp32 fragment, then moments
                safe_set_full_fp32_param(p, full.to(p.device))
                for key in ADAM_MOMENTS:
                    safe_set_full_optimizer_state(p, state["optim"][name][key].to(p.device), key)
                p.copy_(full)  # the model's own copy: whole on every rank under ZeRO-0/1/2
            else:  # ZeRO-0 fp32: the torch optimizer holds the parameter itself
                for key in ADAM_MOMENTS:
                    optimizer.state[p][key].copy_(state["optim"][name][key])
                p.copy_(full)
    if named and zero3.is_partitioned(named[0][1]):
        for pairs in zero3.grouped(engine.module, state["model"]):
            zero3.write_full(pairs)
    _set_adam_step(optimizer, step)
    for g, lr in zip(optimizer.param_groups, state["meta"]["lr"].tolist()):
        g["lr"] = lr


def _set_zero3_partition(p: nn.Parameter, full: torch.Tensor, key: str | None) -> None:
    """This rank's slice of `full` into the ZeRO-3 fp32 partition (key None) or Adam moment `key` of `p`.
    DeepSpeed's own set_full_hp_param (behind safe_set_full_*) slices past the parameter's end on the last
    rank when it is padded to a multiple of the role size; here the slice stops at the end and the padding
    stays zero. Uses the stage-3 optimizer's partition lookup (pinned DeepSpeed range, checks.py)."""
    partition, _ = p._z3_optimizer._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)
    start = partition.numel() * p._z3_optimizer._get_param_partition_rank(p)
    piece = full.reshape(-1)[start:start + partition.numel()]
    partition.data[:piece.numel()].copy_(piece)
    partition.data[piece.numel():].zero_()


def _full_fp32(engine: DeepSpeedEngine, p: nn.Parameter) -> torch.Tensor:
    full = safe_get_full_fp32_param(p)  # ZeRO-1/2/3 (a gather over the role's group); None without a master copy
    if full is not None:
        return full
    if engine.optimizer is not engine.basic_optimizer:
        raise RlrunError("saving DeepSpeed ZeRO-0 with bf16 is not supported yet; use --zero_stage 1 or 2")
    return p.detach().float()


def _full_moment(engine: DeepSpeedEngine, optimizer: torch.optim.Optimizer, p: nn.Parameter, key: str) -> torch.Tensor:
    if hasattr(p, "_hp_mapping") or zero3.is_partitioned(p):
        if not engine.optimizer.state:  # no step yet: Adam's moments are zero
            return torch.zeros(zero3.full_shape(p), dtype=torch.float32)
        return safe_get_full_optimizer_state(p, key)
    state = optimizer.state.get(p, {})
    return state[key].detach().float() if key in state else torch.zeros(p.shape, dtype=torch.float32)


def _adam_step(optimizer: torch.optim.Optimizer) -> float:
    for state in optimizer.state.values():
        if "step" in state:
            return float(state["step"])
    return 0.0


def _set_adam_step(optimizer: torch.optim.Optimizer, step: float) -> None:
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"].fill_(step)
        elif "step" in state:
            state["step"] = int(step)


def _materialize_adam_state(engine: DeepSpeedEngine, optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its (lazily created) Adam state so loaded moments have somewhere to go: one
    step with zero gradients at lr 0 leaves every parameter exactly as it was (AdamW's decay is lr * wd),
    then ZeRO-1/2 link each parameter's fragment of the state (DeepSpeed does this after its first step).
    ZeRO-3's optimizer holds no parameters between steps: each flat fp32 partition is put in its group for
    the zero step, as DeepSpeed's own step does, and the state is read by partition, no link needed."""
    if any("exp_avg" in state for state in optimizer.state.values()):  # a defaultdict: lookups add empty entries
        return
    zero = engine.optimizer
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3
        for sub_group, flat in enumerate(zero.fp32_partitioned_groups_flat):
            group = optimizer.param_groups[zero.sub_group_to_group_id[sub_group]]
            held, group["params"] = group["params"], [flat]
            _zero_step(optimizer, [flat])
            group["params"] = held
    else:
        _zero_step(optimizer, [p for g in optimizer.param_groups for p in g["params"]])
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    if zero is not optimizer and hasattr(zero, "single_partition_of_fp32_groups"):  # ZeRO-1/2
        for lp_params, flat in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups):
            lazy_init_hp_params_optimizer_state(lp_params, flat, optimizer.state)


def _zero_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in params:
        p.grad = None
