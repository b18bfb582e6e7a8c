"""Weights streamed to a vLLM child engine bucket by bucket, so its rank never holds a copy of the policy.

An engine's first rank takes each weight sync in two bucket-sized staging buffers (a BucketSink: received from the
actor's first rank, rlrun.weight_sync.broadcast, or packed from its own gathers when it is an actor rank too,
rlrun.weight_sync.colocated) and hands each bucket on as it is complete:

- tensor parallel 1 (`ChildStreamSink`): the child is handed the two buffers once (shared memory on CPU, CUDA IPC
  handles on a GPU: vllm_handoff). Per bucket the parent says "bucket k is in"; the child copies it out of the
  buffer, acks (the parent may then receive bucket k + 2 into it) and feeds the bucket's tensors to vLLM's reload,
  which consumes a generator (`streamed_weights`). The copy is needed because vLLM's layerwise reload keeps the
  tensors it is given until every weight of their layer has arrived, which may be buckets later (a MoE layer's
  experts); a copy lives until then, about one layer.
- tensor parallel T > 1 (`WeightsFileSink`, on the engine's first rank only): vLLM's T workers are other processes
  that take weights only from a file, so each bucket is written straight into its place in the safetensors file
  they read (rlrun.models.safetensors), and the file is committed and read once every bucket is in.

So the rank's own memory for weights is the two buffers; what vLLM holds is vLLM's. But with engine restarts
(--max_engine_restarts > 0; rlrun.engines.vllm.engine) at tensor parallel 1 the rank also keeps a host copy of each
sync (`WeightCopy`, the policy in its wire dtype), which is what a restarted child is given; at tensor parallel > 1
the weights file is that copy already. A child that fails during a sync does not stop the sync (its buckets keep
arriving: the sync is collective): the sink takes the rest without it and has the engine restart it at the end.
"""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch
from torch import nn

from rlrun.engines.receivers import BucketEntry, BucketSink, bucket_size, entry_view
from rlrun.engines.vllm.handoff import Handoff, check_shm, memory_key, pack, unpack, unshared_bytes
from rlrun.models.safetensors import SafetensorsLayout, StreamedSafetensors, TensorSpec
from rlrun.runtime.errors import RlrunError

WEIGHTS_FILE = "model.safetensors"
_ONE_FILE = 2**62  # bytes per file: never split (the workers read every file of the directory anyway)


class ChildLinkError(RlrunError):
    """The child at the other end of a ChildLink failed, died or stopped answering (rlrun.engines.vllm.child)."""


class ChildLink(Protocol):
    """The parent's side of the child's pipe (rlrun.engines.vllm.child.EngineChild)."""

    def wait_ready(self) -> None: ...

    def send(self, doing: str, *msg: object) -> None: ...

    def reply(self, doing: str) -> object: ...

    def request(self, doing: str, *msg: object) -> object: ...


class WeightCopy:
    """A host copy of the last weight sync as it went to the child, bucket by bucket (uint8, the wire dtype's bytes):
    what a restarted child is given. Buffers are allocated on the first sync and reused."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned  # page-locked: the copy off a GPU staging buffer is faster
        self.plan: list[list[BucketEntry]] = []
        self.buckets: list[torch.Tensor] = []
        self.complete = False  # every bucket of the last sync is in

    def begin(self, plan: list[list[BucketEntry]]) -> None:
        if plan != self.plan:
            self.plan = plan
            self.buckets = [torch.empty(bucket_size(b), dtype=torch.uint8, pin_memory=self.pinned) for b in plan]
        self.complete = False

    def keep(self, index: int, data: torch.Tensor) -> None:
        self.buckets[index].copy_(data)  # synchronous: the staging buffer may be refilled once take() returns

    def end(self) -> None:
        self.complete = True


class EngineSink(BucketSink):
    """A vLLM engine's BucketSink (rlrun.weight_sync.buckets) that times each sync from start() to finish(): what
    the engine reports as its last sync. `model`: the policy on the meta device (the names and shapes).

    `on_failure`: set by an engine that restarts its child (None: a child's failure ends the sync, and the job, as
    any error). Then a failure during a sync is kept, the rest of the sync is taken without the child, and at the end
    the engine replaces the child (which calls attach() and replay())."""

    child: ChildLink
    last_sync_s = 0.0
    _t0 = 0.0
    on_failure: Callable[[ChildLinkError], None] | None = None
    _failure: ChildLinkError | None = None

    def _started(self) -> None:
        self._t0 = time.perf_counter()
        self._failure = None

    def _with_child(self, call: Callable[[], object]) -> None:
        """One exchange with the child, skipped once it failed in this sync."""
        if self._failure is not None:
            return
        try:
            call()
        except ChildLinkError as err:
            if self.on_failure is None:
                raise
            self._failure = err

    def _finished(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            assert self.on_failure is not None
            self.on_failure(failure)  # a new child, given this sync by replay()
        self.last_sync_s = time.perf_counter() - self._t0

    @property
    @abc.abstractmethod
    def has_weights(self) -> bool:
        """A complete sync is kept for replay()."""

    def attach(self, child: ChildLink) -> None:
        """A new child in place of a failed one: it holds none of the weights yet."""
        self.child = child

    @abc.abstractmethod
    def replay(self) -> None:
        """The last complete sync again, to the (new) child; a failure raises (the engine's restart loop counts it)."""


class ChildStreamSink(EngineSink):
    """Tensor parallel 1: each bucket goes to the vLLM child through the staging buffers' shared memory. `copy`: the
    host copy of each sync a restarted child is given (None when the engine does not restart children)."""

    def __init__(
        self, child: ChildLink, model: nn.Module, device: torch.device, copy: WeightCopy | None = None
    ) -> None:
        self.child, self.model = child, model
        self.device = device
        self.copy = copy
        self._plan: list[list[BucketEntry]] = []
        self._buffers: list[torch.Tensor] = []
        self._sent_key: tuple | None = None
        self._acked = 0  # buckets of this sync the child has copied out
        self._count = 0

    def start(self, buckets: list[list[BucketEntry]], buffers: list[torch.Tensor]) -> None:
        self._started()
        if self.copy is not None:
            self.copy.begin(buckets)
        self._plan, self._buffers = buckets, buffers
        self._with_child(self._open)

    def _open(self) -> None:
        """Announce a sync; the first one to a child also hands it the buffers (CPU: moved into shared memory, in
        place, after checking /dev/shm has room) and the bucket plan, which it keeps for every later one."""
        named = [(str(i), b) for i, b in enumerate(self._buffers)]
        handoff: Handoff | None = None
        plan = None
        if memory_key(named) != self._sent_key:
            if self.device.type == "cpu":
                check_shm(
                    unshared_bytes(self._buffers),
                    "handing the vLLM engine child its weight sync buffers (shared memory)",
                )
            handoff, plan = pack(named), self._plan
            self._sent_key = memory_key(named)
        self._acked, self._count = 0, len(self._plan)
        self.child.send("loading weights", "stream", handoff, plan)

    def take(self, index: int) -> None:
        if self.copy is not None:
            self.copy.keep(index, self._buffers[index % 2][: bucket_size(self._plan[index])])
        self._with_child(lambda: self._hand(index))

    def _hand(self, index: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the bucket's receive is done before another process reads it
        self.child.send("loading weights", "bucket", index)

    def release(self, index: int) -> None:
        self._with_child(lambda: self._acks_until(index))

    def _acks_until(self, index: int) -> None:
        while self._acked <= index:
            acked = self.child.reply(f"loading weights (bucket {self._acked + 1} of {self._count})")
            assert acked == self._acked, (acked, self._acked)
            self._acked += 1

    def finish(self) -> None:
        self._with_child(self._loaded)
        if self.copy is not None:
            self.copy.end()
        self._finished()

    def _loaded(self) -> None:
        if self._count:
            self._acks_until(self._count - 1)
        self.child.reply("loading weights")

    @property
    def has_weights(self) -> bool:
        return self.copy is not None and self.copy.complete

    def attach(self, child: ChildLink) -> None:
        self.child = child
        self._sent_key = None  # the new child has not been handed the buffers

    def replay(self) -> None:
        assert self.copy is not None and self.copy.complete
        self._plan = self.copy.plan
        self._open()
        for k, data in enumerate(self.copy.buckets):
            if k >= 2:
                self._acks_until(k - 2)
            self._buffers[k % 2][: data.numel()].copy_(data)
            self._hand(k)
        self._loaded()


class WeightsFileSink(EngineSink):
    """Tensor parallel > 1 (the engine's first rank): each bucket written into the file the child's workers read
    (which is also what a restarted child is given)."""

    def __init__(self, child: ChildLink, model: nn.Module, directory: str) -> None:
        self.child, self.model = child, model
        self.directory = directory
        self._buckets: list[list[BucketEntry]] = []
        self._buffers: list[torch.Tensor] = []
        self._writer: StreamedSafetensors | None = None
        self._committed = False  # the file holds a complete sync

    def start(self, buckets: list[list[BucketEntry]], buffers: list[torch.Tensor]) -> None:
        self._started()
        self._buckets, self._buffers = buckets, buffers
        layout = SafetensorsLayout(
            {e.name: TensorSpec(e.shape, e.dtype) for b in buckets for e in b}, max_shard_size=_ONE_FILE
        )
        self._with_child(self.child.wait_ready)  # the workers are not reading the previous file (nor starting)
        path = os.path.join(self.directory, WEIGHTS_FILE)
        self._committed = False
        if os.path.exists(path):  # the previous push's file goes first: /dev/shm never holds two
            os.unlink(path)
        check_shm(
            layout.total_bytes,
            "the vLLM engine's weights file (its tensor-parallel workers read every weight push from it)",
            self.directory,
        )
        self._writer = StreamedSafetensors(layout, self.directory)

    def take(self, index: int) -> None:
        assert self._writer is not None
        bucket = self._buckets[index]
        data = self._buffers[index % 2][: bucket_size(bucket)]
        data = data.to("cpu")  # one copy per bucket off a GPU; on CPU the buffer itself
        for e in bucket:
            self._writer.write(e.name, entry_view(data, e))

    def release(self, index: int) -> None:
        """Nothing to wait for: take() wrote the bucket before returning."""

    def finish(self) -> None:
        assert self._writer is not None
        self._writer.commit()
        self._writer = None
        self._committed = True
        self._with_child(self.replay)
        self._finished()

    @property
    def has_weights(self) -> bool:
        return self._committed

    def replay(self) -> None:
        self.child.request("loading weights", "weights")


# ---- the child's side ------------------------------------------------------------------------------------------


class StreamState:
    """What the child keeps between syncs: the parent's two staging buffers (over its memory) and the bucket plan."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.plan: list[list[BucketEntry]] = []

    def update(self, handoff: Handoff | None, plan: list[list[BucketEntry]] | None) -> None:
        if handoff is not None:
            self.buffers = [t for _, t in unpack(handoff)]
        if plan is not None:
            self.plan = plan
        if not self.buffers:
            raise RuntimeError("a weight stream began before the parent handed over its staging buffers")


def streamed_weights(conn: Connection, state: StreamState) -> Iterator[tuple[str, Any]]:
    """(name, tensor) for vLLM's reload, bucket by bucket as the parent announces them. Each bucket is copied out of
    its staging buffer and acked before its tensors are yielded, so the parent may refill the buffer at once."""
    for k, bucket in enumerate(state.plan):
        msg = conn.recv()
        if tuple(msg) != ("bucket", k):
            raise RuntimeError(f"weight stream: expected bucket {k}, the parent sent {msg[:2]!r}")
        copy = state.buffers[k % 2][: bucket_size(bucket)].clone()
        if copy.is_cuda:
            torch.cuda.synchronize(copy.device)  # the copy is done before the parent may write the buffer again
        conn.send(("ok", k))
        for e in bucket:
            yield e.name, entry_view(copy, e)
        del copy  # the views vLLM still holds keep it alive; the generator's own reference goes
