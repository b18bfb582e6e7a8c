"""Weight sync when the engines have ranks of their own: the actor's first rank broadcasts the weights to them.

The root gathers the actor one FSDP unit at a time (the other actor ranks only join the all-gathers), writes the
parameters into byte buckets and broadcasts each bucket on the sync group rlrun.launch made, in chunks of about
`chunk_bytes`, asynchronously, so the wire carries chunk k while the root gathers and packs chunk k+1. It
double-buffers its send staging (two bucket-sized buffers; a buffer is refilled only once its previous bucket's
broadcasts completed). The bucket plan is agreed once, at construction, from the root's metadata.

On the engines, by what the engine takes (rlrun.engines.receivers): a KeptModel's parameters ARE views into one
persistent receive buffer per bucket, so receiving needs no unpacking copy; a BucketSink (an engine that keeps no
copy of the policy: vLLM) receives into two staging buffers, alternately, and hands each bucket on as it arrives.

Zero-copy send: when the actor's strategy can move the root's parameters into buckets of their own (an actor on one
rank, parameters already in the wire dtype: ParamSource.zero_copy_blocker), the root's parameters ARE views into its
send buckets too, and each bucket is one broadcast with nothing packed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from rlrun.engines.receivers import (
    BucketEntry,
    BucketSink,
    KeptAdapters,
    KeptModel,
    WeightReceiver,
    bucket_size,
    chunk_bounds,
    entry_view,
    pack_buckets,
)
from rlrun.launch.transfer import broadcast_json, wait_all
from rlrun.runtime.log import get_logger
from rlrun.strategies.blocks import GatherScratch
from rlrun.weight_sync.buckets import WireOrder, bind_engine_views, check_engine_matches, two_staging
from rlrun.weight_sync.sources import ParamSource
from rlrun.weight_sync.wire import Traffic, WireFormat, checksum, scratch_for, verify


class BroadcastSync:
    """The actor's weights from its first rank to the engines' ranks, after each update (module docstring)."""

    def __init__(
        self,
        actor_params: ParamSource | None,
        receiver: WeightReceiver | None,
        sync_group: dist.ProcessGroup | None,
        actor_root: int,
        wire: WireFormat,
        device: torch.device,
        check_names: Sequence[str] = (),
    ) -> None:
        """actor_params: this rank's actor parameters (None off the actor's ranks). receiver: how this rank's engine
        takes each sync; None off the engine ranks. sync_group: the root and the ranks that receive (None elsewhere:
        the other actor ranks, an engine's ranks that its first rank receives for). Collective over the sync group:
        the root's metadata crosses the wire once, and both sides derive the same bucket plan from it and `wire`."""
        self.actor_params = actor_params
        # Parameters whose sums the engines compare with the actor's after every sync (LoRA: merged weights a
        # sync that skipped the adapters would leave unchanged); the root's list travels with the metadata.
        self.check_names = list(check_names)
        self.sink = receiver if isinstance(receiver, BucketSink) else None
        has_model = isinstance(receiver, (KeptModel, BucketSink)) and sync_group is not None
        self.engine_model: nn.Module | None = receiver.model if has_model else None  # type: ignore[union-attr]
        self.group, self.root, self.device, self.wire_dtype = sync_group, actor_root, device, wire.dtype
        self.buckets: list[list[BucketEntry]] = []
        self.chunks: list[list[tuple[int, int, int]]] = []
        self.buffers: list[torch.Tensor] = []  # engines: one receive buffer per bucket; root: the 2 staging buffers
        self._scratch = scratch_for(device)
        self.zero_copy = False
        self.traffic = Traffic()
        self.wire_bytes = 0  # every bucket's bytes (none on a rank outside the sync)
        adapters = receiver if isinstance(receiver, KeptAdapters) and sync_group is not None else None
        if wire.delta and dist.get_rank() == actor_root:
            get_logger(actor_root).info_once(
                "weight sync: --weight_sync_delta needs every actor rank to send its own part (not a LoRA actor, not "
                "--weight_sync_senders root): every sync is full"
            )
        if dist.get_rank() != actor_root and self.engine_model is None and adapters is None:
            return  # actor ranks other than the root only take part in the FSDP all-gathers
        assert sync_group is not None, "the root and every receiving engine rank are in the sync group"
        params = self._agree_on_params(actor_params, sync_group)
        if adapters is not None:  # the engine makes its adapter tensors for the actor's adapters
            self.engine_model = adapters.kept((n, s) for n, s in params).model
        if self.engine_model is not None:
            check_engine_matches(self.engine_model, params)
        groups = wire.together([n for n, _ in params]) if wire.together is not None else ()
        self.buckets = pack_buckets([(n, torch.Size(s), wire.dtype) for n, s in params], wire.bucket_bytes, groups)
        self.wire_bytes = sum(bucket_size(b) for b in self.buckets)
        if self.zero_copy:  # nothing to pack, so nothing to overlap: one broadcast per bucket, the wire's floor
            self.chunks = [[(0, bucket_size(b), len(b) - 1)] for b in self.buckets]
        else:
            self.chunks = [chunk_bounds(b, min(wire.chunk_bytes, wire.bucket_bytes)) for b in self.buckets]
        if (self.engine_model is None and not self.zero_copy) or self.sink is not None:
            # A packing root, or an engine handing each bucket on: two alternating staging buffers
            self.buffers = two_staging(self.buckets, device)
        elif self.engine_model is not None:
            self.buffers = bind_engine_views(self.engine_model, self.buckets, device)
        else:
            assert actor_params is not None
            self.buffers = [torch.empty(bucket_size(b), dtype=torch.uint8, device=device) for b in self.buckets]
            actor_params.home(self._views())

    def _agree_on_params(self, actor_params: ParamSource | None, group: dist.ProcessGroup) -> list[list[Any]]:
        """The root's [name, shape] list in its gather order, whether it sends zero-copy, and its checked names, on
        every rank of the sync group (one broadcast)."""
        meta: dict[str, Any] | None = None
        if dist.get_rank() == self.root:
            assert actor_params is not None
            blocker = actor_params.zero_copy_blocker(self.wire_dtype, self.device)
            meta = {
                "params": [[n, list(s)] for n, s, _ in actor_params.shapes()],
                "zero_copy": blocker is None,
                "check": self.check_names,
            }
            get_logger(dist.get_rank()).info_once(
                "weight sync: the actor's parameters live in the send buckets (zero-copy send)"
                if blocker is None
                else f"weight sync: the root packs its parameters into the send buckets ({blocker})"
            )
        meta = cast("dict[str, Any]", broadcast_json(meta, self.root, group, self.device))
        self.zero_copy = bool(meta["zero_copy"])
        self.check_names = list(meta["check"])
        return cast("list[list[Any]]", meta["params"])

    def _views(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Parameter name -> its view into its bucket's buffer (one buffer per bucket), for `names` or all."""
        views = {e.name: entry_view(buffer, e) for bucket, buffer in zip(self.buckets, self.buffers) for e in bucket}
        return views if names is None else {n: views[n] for n in names}

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def sync(self) -> None:
        """Collective over the actor group and the sync group; every actor and engine rank calls it."""
        # the root posts every bucket once (the backend fans it out to the engine ranks); each engine rank receives it
        self.traffic = Traffic(
            sent=self.wire_bytes if self.actor_params is not None else 0,
            received=self.wire_bytes if self.engine_model is not None else 0,
        )
        if self.actor_params is not None and dist.get_rank() != self.root:
            scratch = self._scratch or GatherScratch()
            for block in self.actor_params.blocks():  # take part in the all-gathers, send nothing
                block.gather(scratch)
        elif self.actor_params is not None:
            self._send()
        elif self.sink is not None and self.engine_model is not None:
            self._receive_streamed(self.sink)
        elif self.engine_model is not None:
            self._receive_in_place(self.engine_model)
        # else: outside the sync (critic-only ranks, an engine's ranks that its first rank receives for)

    def _receive_in_place(self, model: nn.Module) -> None:
        """Every chunk of every bucket straight into the engine's parameters (views into the receive buffers)."""
        assert self.group is not None
        works = [
            dist.broadcast(buffer[start:end], src=self.root, group=self.group, async_op=True)
            for buffer, chunks in zip(self.buffers, self.chunks)
            for start, end, _ in chunks
        ]
        wait_all(works, self.group, self.device, "weight sync: a bucket broadcast")
        if self.check_names:
            sent = cast("dict[str, float]", broadcast_json(None, self.root, self.group, self.device))
            targets = dict(model.named_parameters())
            verify(sent, {n: checksum(targets[n].data) for n in sent})

    def _receive_streamed(self, sink: BucketSink) -> None:
        """Bucket k arrives in staging buffer k % 2 and goes on to the sink; bucket k + 2's receives are posted once
        the sink released bucket k, so the wire carries bucket k + 1 while the sink reads bucket k, and the rank
        never holds more than two buckets."""
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
                (e.name, checksum(entry_view(self.buffers[k % 2], e)))
                for e in self.buckets[k]
                if e.name in self.check_names
            )
            sink.take(k)
            if k + 2 < count:
                sink.release(k)
                pending[k + 2] = post(k + 2)
        sink.finish()
        if self.check_names:
            verify(cast("dict[str, float]", broadcast_json(None, self.root, self.group, self.device)), got)

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
                        checks[name] = checksum(full.full(name).to(self.wire_dtype))
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
