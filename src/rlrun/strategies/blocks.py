"""Weight sync's view of a model: its parameters in blocks, each gathered whole in one collective.

An FSDP2 model's block is one FSDP unit (a `fully_shard`ed module, its own parameters only); an
unsharded model is one block. `ParamBlock.gather` is collective over the unit's mesh; `FullBlock`
holds the result and writes each full parameter straight into its destination (a send bucket, an
engine's weight). `ParamBlock.holdings` is the other view: what THIS rank holds of each parameter (no
collective), so that every actor rank can send its own shard (rlrun.weight_sync.senders). `ParamHoming` is the
strategy surface that lets weight sync's root send a one-rank actor's parameters without a copy. The strategies
(rlrun.strategies) hand their blocks to rlrun.launch.transfer through these types.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeGuard

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard

ALIGN = 16  # bytes: every parameter's piece of a gather buffer starts aligned for any dtype
CPU_GATHER_PART_BYTES = 4 * 2**20  # per rank and all-gather, on CPU (gloo): see ParamBlock
# torch >= 2.10 renamed all_gather_into_tensor (which now warns on every call).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def is_sharded(t: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether `t` is a DTensor: whole only through a collective over its mesh."""
    return isinstance(t, DTensor)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor gathered (collective over its mesh), any other tensor as it is."""
    return t.full_tensor() if is_sharded(t) else t


class ParamHoming(Protocol):
    """Moving this rank's parameters into memory weight sync owns (its send buckets), so its root sends them
    without a copy. Not collective."""

    def zero_copy_blocker(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
        """Why `home_params` cannot move the parameters into buffers of `dtype` on `device` (None: it can)."""
        ...

    def home_params(self, model: nn.Module, views: Mapping[str, torch.Tensor]) -> None:
        """Make each named parameter live in its view, keeping its value (rlrun.strategies.fsdp)."""
        ...


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _is_dim0_sharded(p: torch.Tensor) -> TypeGuard[DTensor]:
    """A parameter sharded the way FSDP2 does by default: Shard(0) over a 1-D mesh."""
    return isinstance(p, DTensor) and p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),) and p.dim() >= 1


@dataclass(frozen=True)
class _Piece:
    """Where one dim-0-sharded parameter sits in every rank's segment of a block's gather buffer."""

    part: int  # which of the block's all-gathers carries it
    offset: int  # bytes from the start of each rank's segment of that all-gather
    rows: tuple[
        int, ...
    ]  # dim-0 rows held by each mesh rank (torch.chunk: ceil(n / world) each, the tail shorter or empty)


class FullBlock:
    """The full parameters of one FSDP unit after its gather (at most one all-gather for the unit).

    `write(name, dest)` copies a parameter from the gathered bytes straight into `dest` (same shape;
    cast to dest's dtype), with no intermediate full tensor; `full(name)` returns a new full tensor.
    """

    def __init__(
        self,
        names: list[str],
        meta: dict[str, tuple[torch.Size, torch.dtype]],
        plain: dict[str, torch.Tensor],
        gathered: list[torch.Tensor],
        pieces: dict[str, _Piece],
    ) -> None:
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
        src = gathered[:full_ranks, piece.offset : piece.offset + nbytes].view(dtype)
        flat[: full_ranks * chunk * inner].view(full_ranks, chunk * inner).copy_(src)
        if full_ranks < len(piece.rows) and piece.rows[full_ranks] > 0:  # the one shorter tail shard
            tail = piece.rows[full_ranks] * inner
            flat[full_ranks * chunk * inner :].copy_(
                gathered[full_ranks, piece.offset : piece.offset + tail * src.element_size()].view(dtype)
            )
        return dest

    def aliases(self, name: str, dest: torch.Tensor) -> bool:
        """Whether `dest` is parameter `name`'s own memory already (a write would copy it onto itself)."""
        src = self._plain.get(name)
        return (
            src is not None
            and src.data_ptr() == dest.data_ptr()
            and src.shape == dest.shape
            and src.dtype == dest.dtype
            and src.is_contiguous()
        )

    def read(self, name: str) -> torch.Tensor:
        """The full parameter, not to be modified: a tensor that needed no gather as it is (no copy), any other a new
        full tensor."""
        plain = self._plain.get(name)
        return plain if plain is not None else self.full(name)

    def full(self, name: str) -> torch.Tensor:
        shape, dtype = self._meta[name]
        device = self._gathered[0].device if self._gathered else self._plain[name].device
        return self.write(name, torch.empty(shape, dtype=dtype, device=device))


@dataclass(frozen=True)
class Holding:
    """What one rank holds of a parameter, as a flat range of the full tensor's elements, and who holds the rest.

    spans: (global rank, first element, end element) of every rank's part, in element order, covering the full
    tensor exactly once (replicas share out a replicated tensor evenly). start/flat: this rank's own elements
    [start, start + flat.numel()) of the flattened full tensor (a replicated tensor: all of it), a view, not a copy."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    spans: tuple[tuple[int, int, int], ...]
    start: int
    flat: torch.Tensor

    @property
    def stop(self) -> int:
        """The end of this rank's own elements."""
        return self.start + self.flat.numel()

    def piece(self, begin: int, end: int) -> torch.Tensor:
        """Elements [begin, end) of the full tensor, from this rank's own part (no copy)."""
        if not (self.start <= begin <= end <= self.stop):
            raise ValueError(
                f"{self.name}: elements [{begin}, {end}) are outside this rank's part {self.start, self.stop}"
            )
        return self.flat[begin - self.start : end - self.start]


class NotHeldInSpans(Exception):
    """A parameter whose placement has no Holding (a 2-D mesh, a shard on another dim): the caller falls back."""


def even_spans(numel: int, ranks: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """A tensor every rank in `ranks` holds whole, shared out: torch.chunk's split of its elements (empty tails
    left out)."""
    chunk = -(-numel // len(ranks)) if numel else 0
    spans = ((r, min(i * chunk, numel), min((i + 1) * chunk, numel)) for i, r in enumerate(ranks))
    return tuple(s for s in spans if s[2] > s[1])


def dim0_spans(shape: torch.Size, ranks: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """The element spans of a tensor sharded on dim 0 over `ranks` as FSDP2 does (torch.chunk: ceil(rows / world)
    rows each, the tail shorter or empty; empty ones left out)."""
    rows, inner = shape[0], math.prod(shape[1:])
    chunk = -(-rows // len(ranks))
    spans = ((r, min(i * chunk, rows) * inner, min((i + 1) * chunk, rows) * inner) for i, r in enumerate(ranks))
    return tuple(s for s in spans if s[2] > s[1])


def local_data_ptr(p: torch.Tensor) -> int:
    """Where this rank's part of `p` lives now: a DTensor's local shard, a ZeRO-3 partition, or the tensor. Read
    without a dispatch (DTensor's `_local_tensor`: `to_local()` costs an op per parameter, per sync)."""
    if isinstance(p, DTensor):
        return int(p._local_tensor.data_ptr())
    partition = getattr(p, "ds_tensor", None)
    return int((partition if partition is not None else p).data_ptr())


def holding(name: str, p: torch.Tensor, replicas: tuple[int, ...]) -> Holding:
    """This rank's part of parameter `p` (FSDP2's dim-0 shard over a 1-D mesh; a tensor that is not a DTensor,
    or one over a one-rank mesh, is held whole by each rank of `replicas`). Raises NotHeldInSpans otherwise."""
    if _is_dim0_sharded(p) and p.device_mesh.size() > 1:
        local = p.detach().to_local()  # type: ignore[attr-defined]  # a DTensor's detach() is a DTensor
        ranks = tuple(int(r) for r in p.device_mesh.mesh.flatten().tolist())
        me = p.device_mesh.get_local_rank()
        start = min(me * -(-p.shape[0] // len(ranks)), p.shape[0]) * math.prod(p.shape[1:])
        return Holding(name, p.shape, p.dtype, dim0_spans(p.shape, ranks), start, local.reshape(-1))
    if is_sharded(p) and not (_is_dim0_sharded(p) and p.device_mesh.size() == 1):
        raise NotHeldInSpans(f"{name} is a DTensor placed {tuple(p.placements)} over a {p.device_mesh.ndim}-D mesh")
    whole = p.detach().to_local() if is_sharded(p) else p.detach()  # type: ignore[attr-defined]
    return Holding(name, p.shape, p.dtype, even_spans(whole.numel(), replicas), 0, whole.reshape(-1))


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
    one all-gather 0.51 s, the same bytes as 4 all-gathers 0.08 s). Parameters that are not DTensors (an unsharded
    model, or a unit
    currently unsharded) and shards over a one-rank mesh need no collective and no copy; any other
    DTensor layout falls back to `full_tensor()`.
    """

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.named = named

    def shapes(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        return [(n, p.shape, p.dtype) for n, p in self.named]  # DTensor.shape is the full (global) shape

    def holdings(self, replicas: tuple[int, ...]) -> list[Holding]:
        """What this rank holds of each parameter (no collective); `replicas`: the ranks that each hold a tensor
        that is not sharded (the role's ranks). Raises NotHeldInSpans for a placement it cannot describe."""
        return [holding(name, p, replicas) for name, p in self.named]

    @torch.no_grad()
    def gather(self, scratch: GatherScratch | None = None) -> FullBlock:
        """Collective over the unit's mesh. With `scratch`, the byte buffers are reused (see GatherScratch)."""
        meta = {n: (p.shape, p.dtype) for n, p in self.named}
        plain: dict[str, torch.Tensor] = {}
        sharded = []
        for name, p in self.named:
            if _is_dim0_sharded(p) and p.device_mesh.size() == 1:
                # a one-rank mesh: the shard is the full tensor, no copy
                plain[name] = p.detach().to_local()  # type: ignore[attr-defined]  # a DTensor's detach() is a DTensor
            elif _is_dim0_sharded(p):
                sharded.append((name, p))
            else:
                plain[name] = full_tensor(p.detach())
        if not sharded:
            return FullBlock([n for n, _ in self.named], meta, plain, [], {})
        mesh = sharded[0][1].device_mesh
        world, me = mesh.size(), mesh.get_local_rank()
        local_ref = sharded[0][1].to_local()
        device = (
            local_ref.device
            if local_ref.device.type == mesh.device_type
            else torch.device(mesh.device_type, torch.accelerator.current_device_index())
        )
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
        locals_ = [local_all[a : a + n] for a, n in zip(starts, part_sizes)]
        gathered = [gathered_all[world * a : world * (a + n)].view(world, n) for a, n in zip(starts, part_sizes)]
        for name, p in sharded:
            shard = p.detach().to_local()  # type: ignore[attr-defined]  # a DTensor's detach() is a DTensor
            piece = pieces[name]
            if shard.shape[0] != piece.rows[me]:
                raise RuntimeError(
                    f"{name}: local shard has {shard.shape[0]} rows, expected {piece.rows[me]} "
                    f"(torch.chunk of {p.shape[0]} over {world} ranks)"
                )
            dst = locals_[piece.part][piece.offset : piece.offset + shard.numel() * shard.element_size()]
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
