"""Weight sync: the actor's weights to the engines after each update.

Weights are big: they move as a few large byte buckets per sync, one broadcast per bucket (chunked, async), with the
bucket plan agreed once at start and the buffers reused; colocated engines take the actor's gathered tensors
directly. Collectives only on the sync group rlrun.launch made.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from rlrun.engines.receivers import (
    BucketEntry,
    BucketSink,
    KeptModel,
    ParamLoader,
    WeightReceiver,
    bucket_size,
    chunk_bounds,
    entry_view,
    pack_buckets,
)
from rlrun.launch.transfer import broadcast_json, wait_all
from rlrun.models.lora import hf_name, is_adapter, lora_pairs, merge_into, merged_weight
from rlrun.runtime.errors import RlrunError
from rlrun.runtime.log import get_logger
from rlrun.strategies.blocks import FullBlock, GatherScratch, ParamBlock, ParamHoming
from rlrun.weight_sync.buckets import WireOrder, two_staging


@dataclass(frozen=True)
class WireFormat:
    """How a sync goes on the wire: buckets of at most `bucket_bytes` in `dtype` (the engines'), broadcast in chunks
    of about `chunk_bytes`; `together`: from the parameter names, the groups the engine runs as one tensor
    (rlrun.engines.native.decoder's fused_groups), kept back to back in the buckets so that its receive buffers hold
    them that way."""

    bucket_bytes: int
    dtype: torch.dtype
    chunk_bytes: int = 16 * 2**20
    together: Callable[[list[str]], Sequence[Sequence[str]]] | None = None


class WeightSync:
    """Push the actor's full weights to every engine rank after each update.

    Colocated (engine ranks == actor ranks): each rank gathers the actor one FSDP unit at a time (one
    all-gather per unit) and writes each parameter straight from the gathered bytes into its engine
    model (or, with a ParamLoader, into a new tensor the loader takes up, so the rank keeps no copy);
    nothing else crosses the wire. Disaggregated: actor rank 0 gathers unit by unit, writes
    the parameters into byte buckets and broadcasts each bucket on the "sync" group in chunks of
    about `chunk_bytes`, asynchronously, so the wire carries chunk k while the root gathers and packs
    chunk k+1. The root double-buffers its send staging (two bucket-sized buffers, a buffer is
    refilled only once its previous bucket's broadcasts completed); engine parameters ARE views into
    one persistent receive buffer per bucket, so receiving needs no unpacking copy. An engine that keeps no copy of
    the policy (vLLM: its own weights live in another process) gives a BucketSink instead: it receives into two
    bucket-sized staging buffers, alternately, and hands each bucket on as it arrives. Zero-copy send: when
    the actor's strategy can move the root's parameters into buckets of their own (an actor on one rank,
    parameters already in the wire dtype: see ParamSource.zero_copy_blocker), the root's parameters ARE
    views into its send buckets too, and each bucket is one broadcast with nothing packed.
    """

    def __init__(
        self,
        *,
        actor_params: ParamSource | None,
        receiver: WeightReceiver | None,
        sync_group: dist.ProcessGroup | None,
        actor_root: int,
        colocated: bool,
        wire: WireFormat,
        device: torch.device,
        check_names: Sequence[str] = (),
    ) -> None:
        """actor_params: this rank's actor parameters (None off the actor's ranks). receiver: how this rank's engine
        takes each sync (rlrun.engines.protocol.Engine.weights); None off the engine ranks, and on an engine's ranks
        that its first rank takes the weights for. wire: the buckets' size, dtype, chunks and kept-together groups,
        the same on every rank of the sync (root and engines derive the same plan from it)."""
        bucket_bytes, wire_dtype, chunk_bytes, together = wire.bucket_bytes, wire.dtype, wire.chunk_bytes, wire.together
        engine_model = receiver.model if isinstance(receiver, (KeptModel, BucketSink)) else None
        sink = receiver if isinstance(receiver, BucketSink) else None
        loader = receiver if isinstance(receiver, ParamLoader) else None
        self.actor_params = actor_params
        # Parameters whose sums the engines compare with the actor's after every sync (LoRA: merged weights a
        # sync that skipped the adapters would leave unchanged); the root's list travels with the metadata.
        self.check_names = list(check_names)
        self.engine_model = engine_model
        self.sink = sink
        self.loader = loader
        self.group = sync_group
        self.root = actor_root
        self.colocated = colocated
        self.device = device
        self.buckets: list[list[BucketEntry]] = []
        self.chunks: list[list[tuple[int, int, int]]] = []
        self.buffers: list[torch.Tensor] = []  # engines: one receive buffer per bucket; root: the 2 staging buffers
        # Actor ranks gather unit by unit through one scratch. On CPU it lives as long as this object
        # (a fresh buffer per sync costs page faults); on an accelerator only for one sync (the
        # caching allocator reuses the memory, and holding a unit's gather buffer through training
        # would cost memory there).
        self._scratch = GatherScratch() if device.type == "cpu" else None
        is_root = dist.get_rank() == actor_root
        self.wire_dtype = wire_dtype
        self.zero_copy = False
        if not colocated and sync_group is None:  # an engine rank whose engine's first rank receives for it
            self.engine_model = None
        if colocated and sink is not None:
            # A colocated engine handing each bucket on: the rank packs its own gathers, nothing crosses the wire
            assert actor_params is not None
            self.buckets = pack_buckets([(n, s, wire_dtype) for n, s, _ in actor_params.shapes()], bucket_bytes)
            self.buffers = two_staging(self.buckets, device)
            return
        if colocated or (not is_root and self.engine_model is None):
            return  # actor ranks other than the root only take part in the FSDP all-gathers
        assert sync_group is not None
        # Metadata crosses the wire once, in the root's gather order; both sides derive the same plan.
        meta: dict[str, Any] | None = None
        if is_root:
            blocker = actor_params.zero_copy_blocker(wire_dtype, device)  # type: ignore[union-attr]
            meta = {
                "params": [[n, list(s)] for n, s, _ in actor_params.shapes()],  # type: ignore[union-attr]
                "zero_copy": blocker is None,
                "check": self.check_names,
            }
            get_logger(dist.get_rank()).info_once(
                "weight sync: the actor's parameters live in the send buckets (zero-copy send)"
                if blocker is None
                else f"weight sync: the root packs its parameters into the send buckets ({blocker})"
            )
        meta = cast("dict[str, Any]", broadcast_json(meta, actor_root, sync_group, device))  # the root's
        self.zero_copy = bool(meta["zero_copy"])
        self.check_names = list(meta["check"])
        params = meta["params"]
        if engine_model is not None:
            self._check_engine_matches(params)
        groups = together([n for n, _ in params]) if together is not None else ()
        self.buckets = pack_buckets([(n, torch.Size(s), wire_dtype) for n, s in params], bucket_bytes, groups)
        if self.zero_copy:  # nothing to pack, so nothing to overlap: one broadcast per bucket, the wire's floor
            self.chunks = [[(0, bucket_size(b), len(b) - 1)] for b in self.buckets]
        else:
            self.chunks = [chunk_bounds(b, min(chunk_bytes, bucket_bytes)) for b in self.buckets]
        if (engine_model is None and not self.zero_copy) or sink is not None:
            # A packing root, or an engine handing each bucket on: two alternating staging buffers
            self.buffers = two_staging(self.buckets, device)
            return
        if engine_model is not None:
            self._bind_engine_views(engine_model)
        else:
            self.buffers = [torch.empty(bucket_size(b), dtype=torch.uint8, device=device) for b in self.buckets]
            actor_params.home(self._views())  # type: ignore[union-attr]

    def _views(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Parameter name -> its view into its bucket's buffer (one buffer per bucket), for `names` or all."""
        views = {e.name: entry_view(buffer, e) for bucket, buffer in zip(self.buckets, self.buffers) for e in bucket}
        return views if names is None else {n: views[n] for n in names}

    def _check_engine_matches(self, meta: list) -> None:
        mine = {n: list(p.shape) for n, p in self.engine_model.named_parameters()}  # type: ignore[union-attr]
        theirs = {n: s for n, s in meta}
        if mine != theirs:
            missing = sorted(set(theirs) - set(mine))[:3]
            extra = sorted(set(mine) - set(theirs))[:3]
            shape = [
                f"{n} (engine {mine[n]}, actor {theirs[n]})" for n in theirs if n in mine and mine[n] != theirs[n]
            ][:3]
            raise RlrunError(
                f"weight sync: the engine model does not match the actor (missing on engine: {missing}, "
                f"only on engine: {extra}, shape differs: {shape}); both must load the same architecture"
            )

    def _bind_engine_views(self, model: nn.Module) -> None:
        """Each engine parameter moves into its bucket's receive buffer, keeping its value. Bucket by bucket: a
        parameter's old memory goes as soon as its bucket is bound (a group kept together shares one bucket), so
        the engine holds its weights plus one bucket at most, never two copies of the model."""
        params = dict(model.named_parameters())
        with torch.no_grad():
            for bucket in self.buckets:
                buffer = torch.empty(bucket_size(bucket), dtype=torch.uint8, device=self.device)
                for e in bucket:
                    view = entry_view(buffer, e)
                    view.copy_(params[e.name].data)
                    params[e.name].data = view
                self.buffers.append(buffer)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def sync(self) -> None:
        """Collective over the actor group and the sync group; every actor and engine rank calls it."""
        if self.actor_params is None and self.engine_model is None:
            return  # outside the sync: critic-only ranks, an engine's ranks that its first rank receives for
        if self.colocated:
            if self.actor_params is None:
                return  # a rank outside the actor/engine block (e.g. critic-only ranks) has nothing to sync
            if self.loader is not None:
                self.loader.load(self._gathered())
                return
            if self.sink is not None:
                self._pack_streamed(self.sink)
                return
            if self.engine_model is None:  # this engine's first rank hands the weights on: only gather
                scratch = self._scratch or GatherScratch()
                for block in self.actor_params.blocks():
                    block.gather(scratch)
                return
            targets = dict(self.engine_model.named_parameters())
            scratch = self._scratch or GatherScratch()
            sent: dict[str, float] = {}
            with torch.no_grad():
                for block in self.actor_params.blocks():
                    full = block.gather(scratch)
                    for name in full.names:
                        full.write(name, targets[name].data)
                        if name in self.check_names:
                            sent[name] = _checksum(full.full(name).to(targets[name].dtype))
            self._verify(sent, {n: _checksum(targets[n].data) for n in sent})
            return
        if self.actor_params is not None and dist.get_rank() != self.root:
            scratch = self._scratch or GatherScratch()
            for block in self.actor_params.blocks():  # take part in the all-gathers, send nothing
                block.gather(scratch)
            return
        if self.actor_params is not None:
            self._send()
            return
        if self.sink is not None:
            self._receive_streamed(self.sink)
            return
        # an engine rank that receives: it has its model and the sync group (see __init__)
        assert self.engine_model is not None and self.group is not None
        works = [
            dist.broadcast(buffer[start:end], src=self.root, group=self.group, async_op=True)
            for buffer, chunks in zip(self.buffers, self.chunks)
            for start, end, _ in chunks
        ]
        wait_all(works, self.group, self.device, "weight sync: a bucket broadcast")
        if self.check_names:
            sent = cast("dict[str, float]", broadcast_json(None, self.root, self.group, self.device))
            targets = dict(self.engine_model.named_parameters())
            self._verify(sent, {n: _checksum(targets[n].data) for n in sent})

    def _gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Colocated with a loader: each parameter as a new full tensor in the engines' dtype, gathered unit by unit
        (collective over the actor group as it is iterated)."""
        assert self.actor_params is not None
        scratch = self._scratch or GatherScratch()
        for block in self.actor_params.blocks():
            shapes = {name: shape for name, shape, _ in block.shapes()}
            with torch.no_grad():
                full = block.gather(scratch)
                tensors = [
                    (name, full.write(name, torch.empty(shapes[name], dtype=self.wire_dtype, device=self.device)))
                    for name in full.names
                ]
            yield from tensors  # written out before the next unit's gather reuses the scratch

    def _pack_streamed(self, sink: BucketSink) -> None:
        """Colocated with a sink: each parameter, as its unit is gathered, goes into its bucket's staging buffer;
        a full bucket goes to the sink, and a buffer is refilled once the sink released its previous bucket. The
        buckets fill in order: they were planned in the gather order."""
        assert self.actor_params is not None
        sink.start(self.buckets, self.buffers)
        place = {e.name: (k, e) for k, bucket in enumerate(self.buckets) for e in bucket}
        left = [len(bucket) for bucket in self.buckets]
        scratch = self._scratch or GatherScratch()
        with torch.no_grad():
            for block in self.actor_params.blocks():
                full = block.gather(scratch)
                for name in full.names:
                    k, e = place.pop(name)
                    if k >= 2 and left[k] == len(self.buckets[k]):  # the bucket's first parameter: its buffer's
                        sink.release(k - 2)  # previous bucket must be done with
                    full.write(name, entry_view(self.buffers[k % 2], e))
                    left[k] -= 1
                    if left[k] == 0:
                        sink.take(k)
        assert not place, "the actor yielded fewer parameters than the bucket plan"
        sink.finish()

    def _receive_streamed(self, sink: BucketSink) -> None:
        """Engine with a sink: bucket k arrives in staging buffer k % 2 and goes on to the sink; bucket k + 2's
        receives are posted once the sink released bucket k, so the wire carries bucket k + 1 while the sink
        reads bucket k, and the rank never holds more than two buckets."""
        assert self.group is not None
        sink.start(self.buckets, self.buffers)
        count = len(self.buckets)

        def post(k: int) -> list[dist.Work]:
            buffer = self.buffers[k % 2]
            return [
                dist.broadcast(buffer[start:end], src=self.root, group=self.group, async_op=True)
                for start, end, _ in self.chunks[k]
            ]

        pending = {k: post(k) for k in range(min(2, count))}
        got: dict[str, float] = {}
        for k in range(count):
            wait_all(pending.pop(k), self.group, self.device, "weight sync: a bucket broadcast")
            got.update(
                (e.name, _checksum(entry_view(self.buffers[k % 2], e)))
                for e in self.buckets[k]
                if e.name in self.check_names
            )
            sink.take(k)
            if k + 2 < count:
                sink.release(k)
                pending[k + 2] = post(k + 2)
        sink.finish()
        if self.check_names:
            self._verify(broadcast_json(None, self.root, self.group, self.device), got)  # type: ignore[arg-type]

    def _verify(self, sent: dict[str, float], got: Mapping[str, float]) -> None:
        """The engine's copies of the checked parameters sum as the actor's sent tensors did."""
        for name, expected in sent.items():
            got_sum = got[name]
            if not math.isclose(got_sum, expected, rel_tol=1e-6, abs_tol=1e-6):
                raise RlrunError(
                    f"weight sync: after the sync the engine's {name} sums to {got_sum:.6g} but the actor "
                    f"sent {expected:.6g}: the engine did not receive the actor's weights"
                )

    def _staging(self, bucket: int) -> torch.Tensor:
        """The root's send buffer of `bucket`: its own (zero-copy) or the staging buffer of its parity."""
        return self.buffers[bucket] if self.zero_copy else self.buffers[bucket % 2]

    def _send(self) -> None:
        """Root: gather unit by unit, put each parameter into its bucket and every chunk on the wire (async, in the
        plan's order, as the engines post their receives) as soon as it and every chunk before it are filled.
        Packing: into two alternating staging buffers, a chunk of bucket k on the wire while chunk k+1 is packed.
        Zero-copy: the parameters already live in their buckets; one that does not any more (woken from sleep into
        new memory, replaced by a load) is copied and re-homed. The plan may place a parameter ahead of others
        gathered before it (groups kept together), never further than into the next bucket."""
        assert self.actor_params is not None and self.group is not None
        wire = WireOrder(self.buckets, self.chunks)
        place = {e.name: (k, e) for k, bucket in enumerate(self.buckets) for e in bucket}
        in_flight: list[list[dist.Work]] = [[] for _ in self.buckets]
        started: set[int] = set()
        scratch = self._scratch or GatherScratch()
        strays: list[str] = []
        checks: dict[str, float] = {}
        with torch.no_grad():
            for block in self.actor_params.blocks():
                full = block.gather(scratch)
                for name in full.names:
                    k, e = place.pop(name)  # the plan holds every name the root gathers, once
                    staging = self._staging(k)
                    if not self.zero_copy and k >= 2 and k not in started:  # refill a staging buffer only after
                        # its last bucket left
                        assert wire.all_posted(k - 2), "weight sync: the plan put a parameter two buckets ahead"
                        wait_all(in_flight[k - 2], self.group, self.device, "weight sync: a bucket broadcast")
                    started.add(k)
                    view = entry_view(staging, e)
                    if not (self.zero_copy and full.aliases(name, view)):
                        full.write(name, view)
                        if self.zero_copy:
                            strays.append(name)
                    if name in self.check_names:  # computed apart from the bucket it was packed into
                        checks[name] = _checksum(full.full(name).to(self.wire_dtype))
                    for b, start, end in wire.filled(name):
                        in_flight[b].append(
                            dist.broadcast(self._staging(b)[start:end], src=self.root, group=self.group, async_op=True)
                        )
        assert not place and wire.all_posted(), "the actor yielded fewer parameters than the bucket plan"
        wait_all([w for works in in_flight for w in works], self.group, self.device, "weight sync: a bucket broadcast")
        if self.check_names:
            broadcast_json(checks, self.root, self.group, self.device)
        if self.zero_copy and strays and self.actor_params.zero_copy_blocker(self.wire_dtype, self.device) is None:
            self.actor_params.home(self._views(strays))


def _checksum(t: torch.Tensor) -> float:
    return float(t.detach().double().sum())


class ParamSource:
    """The actor's parameters, grouped by FSDP unit in gather order (a thin adapter over the strategy), and,
    when the strategy can (`homing`), moved into the sync's send buckets so the root sends them without a copy."""

    def __init__(
        self,
        model: nn.Module,
        param_blocks: Callable[[nn.Module], list[ParamBlock]],
        homing: ParamHoming | None = None,
    ) -> None:
        self.model = model
        self._param_blocks = param_blocks
        self._homing = homing

    def zero_copy_blocker(self, dtype: torch.dtype, device: torch.device) -> str | None:
        """Why the root cannot send the parameters' own memory (None: it can, after `home`)."""
        if self._homing is None:
            return "the actor's strategy offers no re-homing"
        return self._homing.zero_copy_blocker(self.model, dtype, device)

    def home(self, views: Mapping[str, torch.Tensor]) -> None:
        """Each named parameter takes its view's memory (keeping its value)."""
        assert self._homing is not None
        self._homing.home_params(self.model, views)

    def blocks(self) -> list[ParamBlock]:
        """Each block's gather() is collective over the actor group."""
        return self._param_blocks(self.model)

    def shapes(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        """(name, full shape, dtype) in gather order (no collective)."""
        return [s for block in self.blocks() for s in block.shapes()]

    def full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, new full tensor) in gather order. Collective: every actor rank must iterate to the end."""
        scratch = GatherScratch()
        for block in self.blocks():
            full = block.gather(scratch)
            for name in full.names:
                yield name, full.full(name)


# ---- LoRA-merged sources -----------------------------------------------------------------------------------------
# What a LoRA actor sends the generation engines: the merged weights (base + scaling * B @ A) under the base model's
# names, one FSDP unit at a time like a full actor's, so every engine backend (native, HF, vLLM) loads them unchanged.
#
# verl's issue 7495 (a LoRA sync that silently sent nothing) is why the weight sync checks what arrived: the merged
# tensors named by `check_names` are summed on both sides (rlrun.weight_sync.sync.WeightSync).


class MergedFull:
    """A gathered unit of a PEFT model seen as the merged base model's parameters (hf names)."""

    def __init__(self, inner: FullBlock, scaling: float, pairs: dict[str, tuple[str, str]]) -> None:
        self.inner, self.scaling = inner, scaling
        self._peft = {hf_name(n): n for n in inner.names if not is_adapter(n)}
        self._pairs = pairs
        self.names = list(self._peft)

    def full(self, name: str) -> torch.Tensor:
        peft = self._peft[name]
        base = self.inner.full(peft)
        if peft not in self._pairs:
            return base
        a, b = self._pairs[peft]
        return merged_weight(base, self.inner.full(a), self.inner.full(b), self.scaling)

    def write(self, name: str, dest: torch.Tensor) -> torch.Tensor:
        """The merged weight into `dest` (the engine's parameter, or a send bucket's view) with no full-size
        temporary: the base written as it is, then the adapter's product added in place. `full` gives the same
        bits for a tensor of dest's dtype (the sync's check relies on it)."""
        peft = self._peft[name]
        self.inner.write(peft, dest)
        if peft in self._pairs:
            a, b = self._pairs[peft]
            merge_into(dest, self.inner.full(a), self.inner.full(b), self.scaling)
        return dest

    def aliases(self, name: str, dest: torch.Tensor) -> bool:
        return False  # a merged weight is computed, never the actor's own memory


class MergedBlock:
    """One FSDP unit of a PEFT model: gathers as the unit does, yields merged weights. A LoRA layer's base weight and
    adapters sit in the same unit (the decoder layer), so each unit merges on its own."""

    def __init__(self, inner: ParamBlock, scaling: float) -> None:
        self.inner, self.scaling = inner, scaling
        self._pairs = lora_pairs([n for n, _ in inner.named])

    def shapes(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        return [(hf_name(n), s, d) for n, s, d in self.inner.shapes() if not is_adapter(n)]

    def gather(self, scratch: GatherScratch | None = None) -> MergedFull:
        return MergedFull(self.inner.gather(scratch), self.scaling, self._pairs)


class MergedLoraParams(ParamSource):
    """The LoRA actor as the weight sync's source: merged weights, packed into the send buckets (never zero-copy)."""

    def __init__(self, model: nn.Module, param_blocks: Callable[[nn.Module], list[ParamBlock]], scaling: float) -> None:
        super().__init__(model, param_blocks, None)
        self.scaling = scaling

    def zero_copy_blocker(self, dtype: torch.dtype, device: torch.device) -> str | None:
        return "LoRA: the engines get base + adapter merged, computed per unit"

    def blocks(self) -> list[MergedBlock]:  # type: ignore[override]
        return [MergedBlock(b, self.scaling) for b in self._param_blocks(self.model)]

    def check_names(self) -> list[str]:
        """Merged weights the sync verifies on the engines: the first and last adapted layer's (cheap, and a sync
        that skipped the adapters, or sent the base alone, changes neither)."""
        adapted = [
            hf_name(base) for b in self._param_blocks(self.model) for base in lora_pairs([n for n, _ in b.named])
        ]
        return list(dict.fromkeys(adapted[:1] + adapted[-1:]))
