"""Moving tensors between roles: rollout exchange, result exchange, weight sync.

Tokens are small, so rollouts move simply (padded tensors + lengths, one gather). Weights are
big: they move as a few large byte buckets per sync, one broadcast per bucket, with the bucket
plan agreed once at start and the buffers reused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from rlrun.errors import RlrunError

ALIGN = 16  # bytes: every tensor view into a bucket starts aligned for any dtype
# torch >= 2.10 renamed all_gather_into_tensor (which now warns on every call).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_from(ranks: Sequence[int], local: torch.Tensor | None, shape: Sequence[int], dtype: torch.dtype,
                group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """Concatenate (dim 0) one [*shape] tensor from each rank in `ranks`, in that order; every
    rank of `group` receives the result. Ranks outside `ranks` pass local=None."""
    group_ranks = dist.get_process_group_ranks(group)
    if list(ranks) == list(group_ranks):
        assert local is not None
        out = torch.empty((len(ranks) * shape[0], *shape[1:]), dtype=dtype, device=device)
        _all_gather_single(out, local.to(device).contiguous(), group=group)
        return out
    parts = []
    me = dist.get_rank()
    for src in ranks:
        buf = local.to(device).contiguous() if src == me and local is not None else torch.empty(tuple(shape), dtype=dtype, device=device)
        dist.broadcast(buf, src=src, group=group)
        parts.append(buf)
    return torch.cat(parts, dim=0)


def all_gather_vectors(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[S] from every rank of `group` -> [world, S] on every rank."""
    world = dist.get_world_size(group)
    out = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    _all_gather_single(out, local.contiguous(), group=group)
    return out.view(world, local.numel())


def broadcast_json(obj: object, src: int, group: dist.ProcessGroup, device: torch.device) -> object:
    """Small metadata as JSON bytes (never pickle: nothing is unpickled from another host)."""
    if dist.get_rank() == src:
        payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.empty(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if dist.get_rank() != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src, group=group)
    return json.loads(bytes(payload.cpu().tolist()).decode())


@dataclass(frozen=True)
class BucketEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the bucket start
    nbytes: int


def plan_buckets(params: Iterable[tuple[str, torch.Size, torch.dtype]], bucket_bytes: int) -> list[list[BucketEntry]]:
    """Greedy, order-preserving packing of parameters into buckets of at most bucket_bytes
    (a parameter larger than a bucket gets a bucket of its own)."""
    buckets: list[list[BucketEntry]] = [[]]
    used = 0
    for name, shape, dtype in params:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if buckets[-1] and used + nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(BucketEntry(name, tuple(shape), dtype, used, nbytes))
        used += -(-nbytes // ALIGN) * ALIGN
    return [b for b in buckets if b]


def bucket_size(bucket: list[BucketEntry]) -> int:
    last = bucket[-1]
    return -(-(last.offset + last.nbytes) // ALIGN) * ALIGN


def entry_view(buffer: torch.Tensor, e: BucketEntry) -> torch.Tensor:
    return buffer[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)


class WeightSync:
    """Push the actor's full weights to every engine rank after each update.

    Colocated (engine ranks == actor ranks): each rank copies the gathered parameters into its
    engine model; nothing crosses the wire beyond FSDP's own all-gather. Disaggregated: actor
    rank 0 packs parameters into byte buckets and broadcasts each bucket on the "sync" group;
    engine parameters ARE views into the receive buckets, so receiving needs no unpacking copy.
    """

    def __init__(self, *, actor_params: "ParamSource | None", engine_model: nn.Module | None,
                 sync_group: dist.ProcessGroup | None, actor_root: int, colocated: bool,
                 bucket_bytes: int, wire_dtype: torch.dtype, device: torch.device) -> None:
        self.actor_params = actor_params
        self.engine_model = engine_model
        self.group = sync_group
        self.root = actor_root
        self.colocated = colocated
        self.device = device
        self.buckets: list[list[BucketEntry]] = []
        self.buffers: list[torch.Tensor] = []
        is_root = dist.get_rank() == actor_root
        if colocated or (not is_root and engine_model is None):
            return  # actor ranks other than the root only take part in the FSDP all-gathers
        assert sync_group is not None
        # Metadata crosses the wire once; both sides then derive the same bucket plan from it.
        meta = [[n, list(s)] for n, s, _ in actor_params.shapes()] if is_root else None  # type: ignore[union-attr]
        meta = broadcast_json(meta, actor_root, sync_group, device)
        if engine_model is not None:
            self._check_engine_matches(meta)  # type: ignore[arg-type]
        self.buckets = plan_buckets([(n, torch.Size(s), wire_dtype) for n, s in meta], bucket_bytes)  # type: ignore[union-attr]
        self.buffers = [torch.empty(bucket_size(b), dtype=torch.uint8, device=device) for b in self.buckets]
        if engine_model is not None:
            self._bind_engine_views(engine_model)

    def _check_engine_matches(self, meta: list) -> None:
        mine = {n: list(p.shape) for n, p in self.engine_model.named_parameters()}  # type: ignore[union-attr]
        theirs = {n: s for n, s in meta}
        if mine != theirs:
            missing = sorted(set(theirs) - set(mine))[:3]
            extra = sorted(set(mine) - set(theirs))[:3]
            shape = [f"{n} (engine {mine[n]}, actor {theirs[n]})" for n in theirs if n in mine and mine[n] != theirs[n]][:3]
            raise RlrunError(f"weight sync: the engine model does not match the actor (missing on engine: {missing}, "
                             f"only on engine: {extra}, shape differs: {shape}); both must load the same architecture")

    def _bind_engine_views(self, model: nn.Module) -> None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for bucket, buffer in zip(self.buckets, self.buffers):
                for e in bucket:
                    view = entry_view(buffer, e)
                    view.copy_(params[e.name].data)
                    params[e.name].data = view

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def sync(self) -> None:
        """Collective over the actor group and the sync group; every actor and engine rank calls it."""
        if self.colocated:
            if self.actor_params is None:
                return  # a rank outside the actor/engine block (e.g. critic-only ranks) has nothing to sync
            assert self.engine_model is not None
            targets = dict(self.engine_model.named_parameters())
            with torch.no_grad():
                for name, full in self.actor_params.full():
                    targets[name].data.copy_(full)
            return
        if self.actor_params is not None and dist.get_rank() != self.root:
            for _ in self.actor_params.full():  # take part in the all-gathers, send nothing
                pass
            return
        if self.actor_params is not None:  # root: pack each bucket as its parameters arrive
            it = self.actor_params.full()
            with torch.no_grad():
                for bucket, buffer in zip(self.buckets, self.buffers):
                    for e in bucket:
                        name, full = next(it)
                        assert name == e.name, (name, e.name)
                        entry_view(buffer, e).copy_(full)
                    dist.broadcast(buffer, src=self.root, group=self.group)
            return
        for buffer in self.buffers:  # engine: the broadcast writes straight into the parameters
            dist.broadcast(buffer, src=self.root, group=self.group)


class ParamSource:
    """The actor's parameters as full tensors, in a fixed order (a thin adapter over the strategy)."""

    def __init__(self, model: nn.Module, full_params: "callable") -> None:  # type: ignore[valid-type]
        self.model = model
        self._full_params = full_params

    def shapes(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        out = []
        for name, p in self.model.named_parameters():
            shape = p.shape  # DTensor.shape is the full (global) shape
            out.append((name, shape, p.dtype))
        return out

    def full(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._full_params(self.model)
