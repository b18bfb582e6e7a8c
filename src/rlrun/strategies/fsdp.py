"""FSDP2 training strategy on a role's process group.

Implements the `Strategy` surface of rlrun.strategies.base (wrap, step, clip_grad_norm, full
parameters by FSDP unit, full/sharded state dicts, sleep/wake); the DeepSpeed strategy sits next to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from rlrun.models.weights import Unfilled, WeightSource
from rlrun.strategies.base import ALL_UNITS, OptimizerFactory, SleepUnit, StepOps, TorchSteps
from rlrun.strategies.blocks import ParamBlock, full_tensor, param_blocks
from rlrun.strategies.parking import SleepBook, awake_meanwhile

# ---- re-homing parameters ----------------------------------------------------------------------------------------
# FSDP2 parameters that live in memory the caller owns: weight sync's send buckets (zero-copy send).
#
# An actor on ONE rank holds every parameter whole (FSDP2 shards over a one-rank mesh). When those shards ARE the
# byte buckets the weight sync broadcasts, the sync's root sends them as they are, with no packing copy: the
# difference between ~1.5x and ~1.0x of one raw broadcast (bench/weight_sync.py). This module re-points the shards;
# it reaches into FSDP2's per-parameter record (`FSDPParam`: its flat shard, which FSDP's all-gathers read), so
# it checks that record's form first and declines (a reason, never an error) when this torch lays it out
# differently, or when the parameters are sharded over several ranks, offloaded, or in another dtype.


def _fsdp_params_by_param(model: nn.Module) -> dict[int, object]:
    """id(sharded parameter) -> FSDP2's FSDPParam that manages it (torch-internal objects; {} when this torch
    lays them out differently)."""
    out: dict[int, object] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            group = getattr(state, "_fsdp_param_group", None)
            for fsdp_param in getattr(group, "fsdp_params", None) or []:
                out[id(getattr(fsdp_param, "sharded_param", None))] = fsdp_param
    return out


def _param_blocker(
    name: str, p: torch.Tensor, fsdp_param: object | None, has_units: bool, dtype: torch.dtype, device: torch.device
) -> str | None:
    if p.dtype != dtype:
        return f"{name} is {p.dtype}, the engines take {dtype} (the send casts)"
    if isinstance(p, DTensor):
        if not tuple(p.placements) == (Shard(0),) or p.device_mesh.size() != 1:
            return f"{name} is sharded over {p.device_mesh.size()} ranks (the root gathers it)"
        if (
            fsdp_param is None
            or type(getattr(fsdp_param, "_sharded_param_data", None)) is not torch.Tensor
            or getattr(fsdp_param, "offload_to_cpu", True)
        ):
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
            raise ValueError(
                f"{name}: cannot home a {tuple(p.shape)} {p.dtype} parameter in a {tuple(view.shape)} {view.dtype} view"
            )
        if isinstance(p, DTensor):
            fsdp_param = by_param[id(p)]
            view.copy_(p.to_local())
            p._local_tensor = view
            fsdp_param._sharded_param_data = view.view(-1)  # type: ignore[attr-defined]
        else:
            view.copy_(p)
            p.data = view


class FSDPStrategy:
    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        *,
        bf16: bool,
        zero_stage: int,
        offload: bool,
        gradient_checkpointing: bool,
    ) -> None:
        self.group = group
        self.device = device
        self.bf16 = bf16 and device.type == "cuda"  # bf16 compute on CPU is slow and not what users want there
        # ZeRO-3 frees gathered parameters after forward; ZeRO-2 keeps them until backward.
        self.reshard_after_forward = zero_stage >= 3
        self.offload = offload and device.type == "cuda"
        self.gradient_checkpointing = gradient_checkpointing
        self._sleep = SleepBook(device)

    def wrap(self, model: nn.Module | Unfilled, *, trainable: bool = True) -> nn.Module:
        """Shard each transformer block, then the root, over this role's ranks. A frozen model below ZeRO-3 stays
        whole on every rank (in bf16 with --bf16), as OpenRLHF's ZeRO-0 reference/reward engines: its
        forwards then gather nothing; at ZeRO-3 it is sharded and gathered per block like the trained models.
        An `Unfilled` model is sharded on the meta device, then each rank reads only the rows it keeps."""
        unfilled = model if isinstance(model, Unfilled) else None
        module = unfilled.model if unfilled is not None else model
        assert isinstance(module, nn.Module)
        if self.gradient_checkpointing and trainable and hasattr(module, "gradient_checkpointing_enable"):
            module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]  # an HF model's method
        if not trainable and not self.reshard_after_forward:
            if self.bf16:
                module.to(torch.bfloat16)  # on the meta device this costs nothing: no fp32 detour
            module = unfilled.fill(self.device) if unfilled is not None else module.to(self.device)
            return module.requires_grad_(False)
        if not trainable and self.bf16:
            module.to(torch.bfloat16)  # a frozen model needs no fp32 master: its shards are bf16 too
        elif self.bf16:
            _frozen_to_bf16(module)  # LoRA's frozen base: fp32 masters only for what is trained
        if unfilled is None:
            module.to(self.device)
        mesh = DeviceMesh.from_group(self.group, self.device.type)
        kwargs: dict = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward or not trainable}
        if self.bf16:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if self.offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        block_names = set(getattr(module, "_no_split_modules", None) or [])
        for sub in module.modules():
            if type(sub).__name__ in block_names:
                fully_shard(sub, **kwargs)
        for sub in vocab_units(module):
            fully_shard(sub, **kwargs)
        fully_shard(module, **kwargs)
        if unfilled is not None:
            unfilled.fill(
                self.device, param_device=torch.device("cpu") if self.offload else self.device, read_into=read_shard
            )
        if not trainable:
            module.requires_grad_(False)
        return module

    def wrap_trainable(
        self, model: nn.Module | Unfilled, make_optimizer: OptimizerFactory
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        module = self.wrap(model)
        return module, make_optimizer(module)

    def step_ops(self, model: nn.Module) -> StepOps:
        return TorchSteps()  # FSDP2 reduce-scatters gradients inside loss.backward()

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        with awake_meanwhile(self, model, None, frozenset({SleepUnit.PARAMS})):
            return full_state_dict(model, self.group)

    @contextlib.contextmanager
    def export_view(self, model: nn.Module) -> Iterator[tuple[nn.Module, list[ParamBlock]]]:
        with awake_meanwhile(self, model, None, frozenset({SleepUnit.PARAMS})):
            yield model, param_blocks(model)

    def save_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        with awake_meanwhile(self, model, optimizer):
            save_role_state(model, optimizer, path, self.group)

    def load_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        with awake_meanwhile(self, model, optimizer):
            load_role_state(model, optimizer, path, self.group)

    # ---- sleep (--sleep) ---------------------------------------------------------

    @staticmethod
    def _part(model: nn.Module, optimizer: torch.optim.Optimizer | None, part: SleepUnit) -> list[torch.Tensor]:
        """The tensors of one part: sharded parameters and buffers, or gradients and optimizer state
        (DTensors: parking takes their local shards; with CPUOffloadPolicy they are on the CPU already and stay)."""
        if part is SleepUnit.PARAMS:
            return [*model.parameters(), *model.buffers()]
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        state = (
            []
            if optimizer is None
            else [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        )
        return grads + state

    def sleep(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, parts: frozenset[SleepUnit] = ALL_UNITS
    ) -> int:
        if SleepUnit.PARAMS in parts:
            self.release_gathered(model)
        moved = 0
        for part in sorted(parts, key=lambda p: p.value):
            keep = self._part(model, optimizer, SleepUnit.PARAMS) if part is SleepUnit.STATES else []
            moved += self._sleep.sleep(model, part, self._part(model, optimizer, part), keep, model, optimizer)
        return moved

    def wake(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, parts: frozenset[SleepUnit] = ALL_UNITS
    ) -> int:
        return sum(self._sleep.wake(model, part) for part in sorted(parts, key=lambda p: p.value))

    def asleep(self, model: nn.Module) -> frozenset[SleepUnit]:
        return self._sleep.asleep(model)

    def release_gathered(self, model: nn.Module) -> None:
        # A no-grad forward of a trainable model (reshard_after_forward=False) leaves its gathered parameters
        # registered; reshard so the module holds only its shards, the gathered copies are freed and the next
        # forward gathers again (from the shards, whatever changed them meanwhile).
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """Clip over all shards; returns the total norm before clipping (inf/nan when non-finite)."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        return float(full_tensor(norm))

    def full_params(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every parameter, one all-gather per parameter (tests and the
        benchmark's baseline; weight sync gathers per unit, `param_blocks`). Collective: every rank of
        the role must iterate."""
        self._sleep.require_awake(model, SleepUnit.PARAMS, "full_params")
        for name, param in model.named_parameters():
            yield name, full_tensor(param.detach())

    def param_blocks(self, model: nn.Module) -> list[ParamBlock]:
        """The parameters grouped by FSDP unit, in gather order (see `param_blocks`)."""
        self._sleep.require_awake(model, SleepUnit.PARAMS, "weight sync")
        return param_blocks(model)

    def zero_copy_blocker(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
        return zero_copy_blocker(model, dtype, device)

    def home_params(self, model: nn.Module, views: Mapping[str, torch.Tensor]) -> None:
        self._sleep.require_awake(model, SleepUnit.PARAMS, "weight sync")
        home_params(model, views)


def _frozen_to_bf16(module: nn.Module) -> None:
    """Frozen parameters of a trained model in bf16 (on the meta device: free). FSDP2 all-gathers every parameter
    in the policy's bf16 whatever its own dtype, so a unit may mix them."""
    cast: dict[int, nn.Parameter] = {}  # tied parameters (embeddings and head) stay one parameter
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and not param.requires_grad and param.dtype != torch.bfloat16:
                if id(param) not in cast:
                    cast[id(param)] = nn.Parameter(param.detach().to(torch.bfloat16), requires_grad=False)
                sub._parameters[name] = cast[id(param)]


def read_shard(param: nn.Parameter, weights: WeightSource, name: str) -> None:
    """Fill this rank's dim-0 shard of an FSDP2 parameter with only its rows of `name` (plain tensors whole)."""
    if not isinstance(param, DTensor):
        param.copy_(weights.read(name, None))
        return
    if any(not isinstance(p, Shard) or p.dim != 0 for p in param.placements):
        raise NotImplementedError(f"{name}: placements {param.placements}; rlrun shards parameters on dim 0 only")
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    local = param._local_tensor  # the storage FSDP2 re-pads from at its lazy init
    if local.numel():
        local.copy_(weights.read(name, (offset[0], offset[0] + shape[0])))


def vocab_units(model: nn.Module) -> list[nn.Module]:
    """The input embedding and the output head as FSDP units of their own, as torchtitan shards them: left in the
    root unit they would stay gathered from the first forward to the end of backward (FSDP2 never reshards its root
    after forward), with their gradients: ~9 GiB per GPU of fp32 for Qwen2.5-7B's 1.1B vocabulary parameters. Tied
    embeddings (one parameter in both) stay in the root: a parameter belongs to one unit."""
    hf = getattr(model, "hf", model)  # a ScalarHeadModel's HF model
    get_in, get_out = getattr(hf, "get_input_embeddings", None), getattr(hf, "get_output_embeddings", None)
    embed = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if embed is None or (head is not None and head.weight is embed.weight):
        return []
    return [m for m in (embed, head) if m is not None]


def full_state_dict(model: nn.Module, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Full CPU tensors on the role's first rank ({} elsewhere). Collective over the role, one entry at a time.
    (Not torch's get_model_state_dict(cpu_offload=True): it keeps the result on GLOBAL rank 0 only, so a role
    on other ranks, e.g. a critic on ranks of its own, got nothing.)"""
    keep = dist.get_rank(group) == 0
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        full = full_tensor(tensor.detach())
        if keep:
            out[name] = full.cpu()
    return out


# ---- checkpoints: sharded, world-size-independent save/load of a role's model + optimizer (torch DCP) ---------------


def save_role_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: str, group: dist.ProcessGroup) -> None:
    """Collective over the role's group: each rank writes its own shards into `path`."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=group)


def load_role_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: str, group: dist.ProcessGroup) -> None:
    """Collective over the role's group; DCP reshards when the role now has a different size."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: STATE_DICT_TYPE = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
