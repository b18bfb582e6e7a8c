"""Weight sync when the engines share the actor's ranks: nothing crosses the wire but the actor's own all-gathers.

Each rank gathers the actor one FSDP unit at a time (one all-gather per unit) and, by what its engine takes
(rlrun.engines.receivers): writes each parameter straight from the gathered bytes into the engine's model
(KeptModel), hands each one as a new tensor to a loader that keeps no copy (ParamLoader: vLLM in this process), or
packs the parameters into two alternating staging buffers and hands each full bucket on (BucketSink: a vLLM child).
An engine rank whose engine's first rank takes the weights for it only joins the gathers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from rlrun.engines.receivers import (
    BucketEntry,
    BucketSink,
    KeptAdapters,
    KeptModel,
    ParamLoader,
    WeightReceiver,
    entry_view,
    pack_buckets,
)
from rlrun.strategies.blocks import GatherScratch
from rlrun.weight_sync.buckets import two_staging
from rlrun.weight_sync.sources import ParamSource
from rlrun.weight_sync.wire import Traffic, WireFormat, checksum, scratch_for, verify


class ColocatedSync:
    """The actor's weights into the engine on the same rank, after each update (module docstring). `check_names`:
    merged weights whose sums are compared after every sync (LoRA: a sync that skipped the adapters)."""

    def __init__(
        self,
        actor_params: ParamSource | None,
        receiver: WeightReceiver | None,
        wire: WireFormat,
        device: torch.device,
        check_names: Sequence[str] = (),
    ) -> None:
        self.actor_params, self.device, self.wire_dtype = actor_params, device, wire.dtype
        self.traffic = Traffic()  # nothing crosses the wire but the actor's own all-gathers
        self.check_names = list(check_names)
        if isinstance(receiver, KeptAdapters):  # the engine makes its adapter tensors for the actor's adapters
            assert actor_params is not None
            receiver = receiver.kept((n, s) for n, s, _ in actor_params.shapes())
        self.engine_model = receiver.model if isinstance(receiver, KeptModel) else None
        self.sink = receiver if isinstance(receiver, BucketSink) else None
        self.loader = receiver if isinstance(receiver, ParamLoader) else None
        self.zero_copy = False
        self.buckets: list[list[BucketEntry]] = []
        self.buffers: list[torch.Tensor] = []  # a sink's two staging buffers
        self._scratch = scratch_for(device)
        if self.sink is not None:  # the rank packs its own gathers for the sink; nothing crosses the wire
            assert actor_params is not None
            self.buckets = pack_buckets([(n, s, wire.dtype) for n, s, _ in actor_params.shapes()], wire.bucket_bytes)
            self.buffers = two_staging(self.buckets, device)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def sync(self) -> None:
        """Collective over the actor's group; every actor rank calls it."""
        if self.actor_params is None:
            return  # a rank outside the actor/engine block (e.g. critic-only ranks) has nothing to sync
        if self.loader is not None:
            self.loader.load(self._gathered())
        elif self.sink is not None:
            self._pack_streamed(self.sink)
        elif self.engine_model is None:  # this engine's first rank takes the weights: only join the gathers
            scratch = self._scratch or GatherScratch()
            for block in self.actor_params.blocks():
                block.gather(scratch)
        else:
            self._write_in_place()

    def _write_in_place(self) -> None:
        assert self.actor_params is not None and self.engine_model is not None
        targets = dict(self.engine_model.named_parameters())
        scratch = self._scratch or GatherScratch()
        sent: dict[str, float] = {}
        with torch.no_grad():
            for block in self.actor_params.blocks():
                full = block.gather(scratch)
                for name in full.names:
                    full.write(name, targets[name].data)
                    if name in self.check_names:
                        sent[name] = checksum(full.full(name).to(targets[name].dtype))
        verify(sent, {n: checksum(targets[n].data) for n in sent})

    def _gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each parameter as a new full tensor in the engines' dtype, gathered unit by unit (collective over the
        actor group as it is iterated)."""
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
        """Each parameter, as its unit is gathered, goes into its bucket's staging buffer; a full bucket goes to the
        sink, and a buffer is refilled once the sink released its previous bucket. The buckets fill in order: they
        were planned in the gather order."""
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
