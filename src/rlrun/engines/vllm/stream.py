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

So the rank's own memory for weights is the two buffers; what vLLM holds is vLLM's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch
from torch import nn

from rlrun.engines.receivers import BucketEntry, BucketSink, bucket_size, entry_view
from rlrun.engines.vllm.handoff import Handoff, check_shm, memory_key, pack, unpack, unshared_bytes
from rlrun.models.safetensors import SafetensorsLayout, StreamedSafetensors, TensorSpec

WEIGHTS_FILE = "model.safetensors"
_ONE_FILE = 2**62  # bytes per file: never split (the workers read every file of the directory anyway)


class ChildLink(Protocol):
    """The parent's side of the child's pipe (rlrun.engines.vllm.child.EngineChild)."""

    def wait_ready(self) -> None: ...

    def send(self, doing: str, *msg: object) -> None: ...

    def reply(self, doing: str) -> object: ...

    def request(self, doing: str, *msg: object) -> object: ...


class EngineSink(BucketSink):
    """A vLLM engine's BucketSink (rlrun.weight_sync.buckets) that times each sync from start() to finish(): what
    the engine reports as its last sync. `model`: the policy on the meta device (the names and shapes)."""

    last_sync_s = 0.0
    _t0 = 0.0

    def _started(self) -> None:
        self._t0 = time.perf_counter()

    def _finished(self) -> None:
        self.last_sync_s = time.perf_counter() - self._t0


class ChildStreamSink(EngineSink):
    """Tensor parallel 1: each bucket goes to the vLLM child through the staging buffers' shared memory."""

    def __init__(self, child: ChildLink, model: nn.Module, device: torch.device) -> None:
        self.child, self.model = child, model
        self.device = device
        self._buffers: list[torch.Tensor] = []
        self._sent_key: tuple | None = None
        self._acked = 0  # buckets of this sync the child has copied out
        self._count = 0

    def start(self, buckets: list[list[BucketEntry]], buffers: list[torch.Tensor]) -> None:
        self._started()
        named = [(str(i), b) for i, b in enumerate(buffers)]
        handoff: Handoff | None = None
        plan = None
        if memory_key(named) != self._sent_key:  # the first sync (the buffers are kept for every later one)
            if self.device.type == "cpu":
                check_shm(
                    unshared_bytes(buffers), "handing the vLLM engine child its weight sync buffers (shared memory)"
                )
            handoff, plan = pack(named), buckets  # CPU: moves the buffers into shared memory, in place
            self._sent_key, self._buffers = memory_key(named), buffers
        self._acked, self._count = 0, len(buckets)
        self.child.send("loading weights", "stream", handoff, plan)

    def take(self, index: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the bucket's receive is done before another process reads it
        self.child.send("loading weights", "bucket", index)

    def release(self, index: int) -> None:
        while self._acked <= index:
            acked = self.child.reply(f"loading weights (bucket {self._acked + 1} of {self._count})")
            assert acked == self._acked, (acked, self._acked)
            self._acked += 1

    def finish(self) -> None:
        if self._count:
            self.release(self._count - 1)
        self.child.reply("loading weights")
        self._finished()


class WeightsFileSink(EngineSink):
    """Tensor parallel > 1 (the engine's first rank): each bucket written into the file the child's workers read."""

    def __init__(self, child: ChildLink, model: nn.Module, directory: str) -> None:
        self.child, self.model = child, model
        self.directory = directory
        self._buckets: list[list[BucketEntry]] = []
        self._buffers: list[torch.Tensor] = []
        self._writer: StreamedSafetensors | None = None

    def start(self, buckets: list[list[BucketEntry]], buffers: list[torch.Tensor]) -> None:
        self._started()
        self._buckets, self._buffers = buckets, buffers
        layout = SafetensorsLayout(
            {e.name: TensorSpec(e.shape, e.dtype) for b in buckets for e in b}, max_shard_size=_ONE_FILE
        )
        self.child.wait_ready()  # the workers are not reading the previous file (nor starting)
        path = os.path.join(self.directory, WEIGHTS_FILE)
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
        self.child.request("loading weights", "weights")
        self._finished()


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
