"""FSDP2 training strategy on a role's process group.

Implements the `Strategy` surface of rlrun.strategies.base (wrap, step, clip_grad_norm, full
parameters by FSDP unit, full/sharded state dicts, sleep/wake); the DeepSpeed strategy sits next to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from rlrun.launch.dcp import load_role_state, save_role_state
from rlrun.strategies import fsdp_homing
from rlrun.strategies.base import ALL_PARTS, OptimizerFactory, Part, StepOps, TorchSteps
from rlrun.strategies.parking import SleepBook, awake_meanwhile

ALIGN = 16  # bytes: every parameter's piece of a gather buffer starts aligned for any dtype
CPU_GATHER_PART_BYTES = 4 * 2**20  # per rank and all-gather, on CPU (gloo): see ParamBlock
# torch >= 2.10 renamed all_gather_into_tensor (which now warns on every call).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class FSDPStrategy:
    def __init__(self, group: dist.ProcessGroup, device: torch.device, *, bf16: bool, zero_stage: int,
                 offload: bool, gradient_checkpointing: bool) -> None:
        self.group = group
        self.device = device
        self.bf16 = bf16 and device.type == "cuda"  # bf16 compute on CPU is slow and not what users want there
        # ZeRO-3 frees gathered parameters after forward; ZeRO-2 keeps them until backward.
        self.reshard_after_forward = zero_stage >= 3
        self.offload = offload and device.type == "cuda"
        self.gradient_checkpointing = gradient_checkpointing
        self._sleep = SleepBook(device)

    def wrap(self, model: nn.Module, *, trainable: bool = True) -> nn.Module:
        """Shard each transformer block, then the root, over this role's ranks. A frozen model below ZeRO-3 stays
        whole on every rank (in bf16 with --bf16), as OpenRLHF's ZeRO-0 reference/reward engines: its
        forwards then gather nothing; at ZeRO-3 it is sharded and gathered per block like the trained models."""
        if self.gradient_checkpointing and trainable and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.to(self.device)
        if not trainable and not self.reshard_after_forward:
            if self.bf16:
                model.to(torch.bfloat16)
            return model.requires_grad_(False)
        mesh = DeviceMesh.from_group(self.group, self.device.type)
        kwargs: dict = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward or not trainable}
        if self.bf16:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if self.offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        block_names = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            if type(module).__name__ in block_names:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        if not trainable:
            model.requires_grad_(False)
        return model

    def wrap_trainable(self, model: nn.Module, make_optimizer: OptimizerFactory) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = self.wrap(model)
        return model, make_optimizer(model)

    def step_ops(self, model: nn.Module) -> StepOps:
        return TorchSteps()  # FSDP2 reduce-scatters gradients inside loss.backward()

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        with awake_meanwhile(self, model, None, frozenset({Part.PARAMS})):
            return full_state_dict(model, self.group)

    def save_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        with awake_meanwhile(self, model, optimizer):
            save_role_state(model, optimizer, path, self.group)

    def load_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
        with awake_meanwhile(self, model, optimizer):
            load_role_state(model, optimizer, path, self.group)

    # ---- sleep (--deepspeed_enable_sleep) ---------------------------------------------------------

    @staticmethod
    def _part(model: nn.Module, optimizer: torch.optim.Optimizer | None, part: Part) -> list[torch.Tensor]:
        """The tensors of one part: sharded parameters and buffers, or gradients and optimizer state
        (DTensors: parking takes their local shards; with CPUOffloadPolicy they are on the CPU already and stay)."""
        if part is Part.PARAMS:
            return [*model.parameters(), *model.buffers()]
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        state = [] if optimizer is None else [v for s in optimizer.state.values() for v in s.values()
                                              if isinstance(v, torch.Tensor)]
        return grads + state

    def sleep(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, parts: frozenset[Part] = ALL_PARTS) -> int:
        if Part.PARAMS in parts:
            # A no-grad forward of a trainable model (reshard_after_forward=False) leaves its gathered parameters
            # registered; reshard so the module holds only its shards, the gathered copies are freed and
            # the next forward gathers again (the same values: nothing changed the shards meanwhile).
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()
        moved = 0
        for part in sorted(parts, key=lambda p: p.value):
            keep = self._part(model, optimizer, Part.PARAMS) if part is Part.STATES else []
            moved += self._sleep.sleep(model, part, self._part(model, optimizer, part), keep, model, optimizer)
        return moved

    def wake(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, parts: frozenset[Part] = ALL_PARTS) -> int:
        return sum(self._sleep.wake(model, part) for part in sorted(parts, key=lambda p: p.value))

    def asleep(self, model: nn.Module) -> frozenset[Part]:
        return self._sleep.asleep(model)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """Clip over all shards; returns the total norm before clipping (inf/nan when non-finite)."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        return float(_full(norm))

    def full_params(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every parameter, one all-gather per parameter (tests and the
        benchmark's baseline; weight sync gathers per unit, `param_blocks`). Collective: every rank of
        the role must iterate."""
        self._sleep.require_awake(model, Part.PARAMS, "full_params")
        for name, param in model.named_parameters():
            yield name, _full(param.detach())

    def param_blocks(self, model: nn.Module) -> list["ParamBlock"]:
        """The parameters grouped by FSDP unit, in gather order (see `param_blocks`)."""
        self._sleep.require_awake(model, Part.PARAMS, "weight sync")
        return param_blocks(model)

    def zero_copy_blocker(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
        return fsdp_homing.zero_copy_blocker(model, dtype, device)

    def home_params(self, model: nn.Module, views: Mapping[str, torch.Tensor]) -> None:
        self._sleep.require_awake(model, Part.PARAMS, "weight sync")
        fsdp_homing.home_params(model, views)


def full_state_dict(model: nn.Module, group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Full CPU tensors on the role's first rank ({} elsewhere). Collective over the role, one entry at a time.
    (Not torch's get_model_state_dict(cpu_offload=True): it keeps the result on GLOBAL rank 0 only, so a role
    on other ranks, e.g. a critic on ranks of its own, got nothing.)"""
    keep = dist.get_rank(group) == 0
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        full = _full(tensor.detach())
        if keep:
            out[name] = full.cpu()
    return out


# ---- full parameters one FSDP unit at a time ---------------------------------------------------------


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _is_dim0_sharded(p: torch.Tensor) -> bool:
    """A parameter sharded the way FSDP2 does by default: Shard(0) over a 1-D mesh."""
    return isinstance(p, DTensor) and p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),) and p.dim() >= 1


@dataclass(frozen=True)
class _Piece:
    """Where one dim-0-sharded parameter sits in every rank's segment of a block's gather buffer."""

    part: int  # which of the block's all-gathers carries it
    offset: int  # bytes from the start of each rank's segment of that all-gather
    rows: tuple[int, ...]  # dim-0 rows held by each mesh rank (torch.chunk: ceil(n / world) each, the tail shorter or empty)


class FullBlock:
    """The full parameters of one FSDP unit after its gather (at most one all-gather for the unit).

    `write(name, dest)` copies a parameter from the gathered bytes straight into `dest` (same shape;
    cast to dest's dtype), with no intermediate full tensor; `full(name)` returns a new full tensor.
    """

    def __init__(self, names: list[str], meta: dict[str, tuple[torch.Size, torch.dtype]],
                 plain: dict[str, torch.Tensor], gathered: list[torch.Tensor], pieces: dict[str, _Piece]) -> None:
        self.names = names
        self._meta = meta
        self._plain = plain  # full tensors that needed no gather from this block's buffer
        self._gathered = gathered  # per all-gather: [world, segment bytes] uint8
        self._pieces = pieces

    def write(self, name: str, dest: torch.Tensor) -> torch.Tensor:
        """Copy parameter `name` into `dest` (exact when dest has the parameter's dtype); returns dest."""
        shape, dtype = self._meta[name]
        if tuple(dest.shape) != tuple(shape):
            raise ValueError(f"{name}: destination shape {tuple(dest.shape)} != parameter shape {tuple(shape)}")
        if name in self._plain:
            return dest.copy_(self._plain[name])
        if not dest.is_contiguous():
            return dest.copy_(self.full(name))
        piece = self._pieces[name]
        gathered = self._gathered[piece.part]
        inner = math.prod(shape[1:])
        chunk = max(piece.rows)  # the full-size shard's rows; ranks holding that many come first
        nbytes = chunk * inner * torch.empty((), dtype=dtype).element_size()
        flat = dest.view(-1)
        full_ranks = sum(r == chunk for r in piece.rows)
        # [full_ranks, chunk * inner]: every full shard in one strided copy
        src = gathered[:full_ranks, piece.offset:piece.offset + nbytes].view(dtype)
        flat[:full_ranks * chunk * inner].view(full_ranks, chunk * inner).copy_(src)
        if full_ranks < len(piece.rows) and piece.rows[full_ranks] > 0:  # the one shorter tail shard
            tail = piece.rows[full_ranks] * inner
            flat[full_ranks * chunk * inner:].copy_(
                gathered[full_ranks, piece.offset:piece.offset + tail * src.element_size()].view(dtype))
        return dest

    def aliases(self, name: str, dest: torch.Tensor) -> bool:
        """Whether `dest` is parameter `name`'s own memory already (a write would copy it onto itself)."""
        src = self._plain.get(name)
        return (src is not None and src.data_ptr() == dest.data_ptr() and src.shape == dest.shape
                and src.dtype == dest.dtype and src.is_contiguous())

    def full(self, name: str) -> torch.Tensor:
        shape, dtype = self._meta[name]
        device = self._gathered[0].device if self._gathered else self._plain[name].device
        return self.write(name, torch.empty(shape, dtype=dtype, device=device))


class GatherScratch:
    """Byte buffers reused by successive block gathers, grown on demand. Reuse matters on CPU: a
    fresh multi-MiB buffer per gather is a fresh mmap, and first-touching its pages (page faults and
    kernel zeroing) cost more than the all-gather itself (measured: 3x on a loaded 2-core box). A
    FullBlock gathered into a scratch is valid only until the next gather into the same scratch."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, key: str, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = self._buffers[key] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]


class ParamBlock:
    """The parameters of one FSDP unit (a `fully_shard`ed module, its own parameters only).

    `gather()` is collective over the unit's mesh: the unit's dim-0 shards travel in ONE all-gather
    of a byte buffer (each rank's segment: its shards back to back, 16-byte aligned, padded to the
    full chunk size) -- on CPU, one per `CPU_GATHER_PART_BYTES` of segment, because gloo's
    all-gather slows down sharply above a few MiB per rank (measured on 2 ranks, 28 MiB per rank:
    one all-gather 0.51 s, the same bytes as 4 all-gathers 0.08 s). Parameters that are not DTensors (an unsharded model, or a unit
    currently unsharded) and shards over a one-rank mesh need no collective and no copy; any other
    DTensor layout falls back to `full_tensor()`.
    """

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.named = named

    def shapes(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        return [(n, p.shape, p.dtype) for n, p in self.named]  # DTensor.shape is the full (global) shape

    @torch.no_grad()
    def gather(self, scratch: GatherScratch | None = None) -> FullBlock:
        """Collective over the unit's mesh. With `scratch`, the byte buffers are reused (see GatherScratch)."""
        meta = {n: (p.shape, p.dtype) for n, p in self.named}
        plain: dict[str, torch.Tensor] = {}
        sharded = []
        for name, p in self.named:
            if _is_dim0_sharded(p) and p.device_mesh.size() == 1:
                plain[name] = p.detach().to_local()  # a one-rank mesh: the shard is the full tensor, no copy
            elif _is_dim0_sharded(p):
                sharded.append((name, p))
            else:
                plain[name] = _full(p.detach())
        if not sharded:
            return FullBlock([n for n, _ in self.named], meta, plain, [], {})
        mesh = sharded[0][1].device_mesh
        world, me = mesh.size(), mesh.get_local_rank()
        local_ref = sharded[0][1].to_local()
        device = local_ref.device if local_ref.device.type == mesh.device_type else \
            torch.device(mesh.device_type, torch.accelerator.current_device_index())
        part_limit = CPU_GATHER_PART_BYTES if device.type == "cpu" else None
        pieces: dict[str, _Piece] = {}
        part_sizes = [0]  # segment bytes per all-gather
        for name, p in sharded:
            assert p.device_mesh == mesh, f"{name}: one FSDP unit spans two meshes"
            chunk = -(-p.shape[0] // world)
            rows = tuple(max(0, min(chunk, p.shape[0] - r * chunk)) for r in range(world))
            nbytes = _aligned(chunk * math.prod(p.shape[1:]) * p.element_size())
            if part_limit is not None and part_sizes[-1] and part_sizes[-1] + nbytes > part_limit:
                part_sizes.append(0)  # a shard larger than the limit gets an all-gather of its own
            pieces[name] = _Piece(len(part_sizes) - 1, part_sizes[-1], rows)
            part_sizes[-1] += nbytes
        scratch = scratch or GatherScratch()
        local_all = scratch.take("local", sum(part_sizes), device)
        gathered_all = scratch.take("gathered", world * sum(part_sizes), device)
        starts = [sum(part_sizes[:i]) for i in range(len(part_sizes))]
        locals_ = [local_all[a:a + n] for a, n in zip(starts, part_sizes)]
        gathered = [gathered_all[world * a:world * (a + n)].view(world, n) for a, n in zip(starts, part_sizes)]
        for name, p in sharded:
            shard = p.detach().to_local()
            piece = pieces[name]
            if shard.shape[0] != piece.rows[me]:
                raise RuntimeError(f"{name}: local shard has {shard.shape[0]} rows, expected {piece.rows[me]} "
                                   f"(torch.chunk of {p.shape[0]} over {world} ranks)")
            dst = locals_[piece.part][piece.offset:piece.offset + shard.numel() * shard.element_size()]
            dst.view(shard.dtype).copy_(shard.reshape(-1))
        for local, out in zip(locals_, gathered):
            _all_gather_single(out.view(-1), local, group=mesh.get_group())
        return FullBlock([n for n, _ in self.named], meta, plain, gathered, pieces)


def param_blocks(model: nn.Module) -> list[ParamBlock]:
    """Every parameter once, grouped by the FSDP unit that owns it (the deepest `fully_shard`ed
    module around it), units in module order (the root unit first), parameters in
    `named_parameters` order within a unit. Parameters outside every unit (or a model without FSDP)
    form one block of their own, placed first. Pure: no collective."""
    units = [prefix for prefix, m in model.named_modules() if isinstance(m, FSDPModule)]
    groups: dict[str | None, list[tuple[str, torch.Tensor]]] = {None: [], **{u: [] for u in units}}
    for name, p in model.named_parameters():
        owners = [u for u in units if u == "" or name.startswith(u + ".")]
        groups[max(owners, key=len) if owners else None].append((name, p))
    return [ParamBlock(named) for named in groups.values() if named]


def full_param_blocks(model: nn.Module, scratch: GatherScratch | None = None) -> Iterator[FullBlock]:
    """Gather `model`'s full parameters one FSDP unit at a time, all through one scratch: each
    FullBlock is valid until the next one is requested. Collective over the model's mesh: every rank
    of the role must iterate to the end."""
    scratch = scratch or GatherScratch()
    for block in param_blocks(model):
        yield block.gather(scratch)
