"""Weight sync's buckets on both sides: the order the root's chunks go on the wire in, the staging buffers, and an
engine model's parameters bound into its receive buffers (the bucket format and the engines' receivers:
rlrun.engines.receivers)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlrun.engines.receivers import BucketEntry, bucket_size, entry_view
from rlrun.runtime.errors import RlrunError


class WireOrder:
    """The root's chunks in the order every engine posts its receives (bucket by bucket, chunk by chunk): a chunk
    goes on the wire once its entries are packed and every chunk before it is on the wire."""

    def __init__(self, buckets: list[list[BucketEntry]], chunks: list[list[tuple[int, int, int]]]) -> None:
        self.order: list[tuple[int, int, int]] = []  # (bucket, start byte, end byte) per chunk
        self.chunk_of: dict[str, int] = {}  # parameter name -> its chunk's index into `order`
        self.unfilled: list[int] = []  # per chunk: entries not packed yet
        self.last_of_bucket: list[int] = []  # per bucket: its last chunk's index into `order`
        for k, (bucket, bounds) in enumerate(zip(buckets, chunks)):
            first = 0
            for start, end, last in bounds:
                self.chunk_of.update((e.name, len(self.order)) for e in bucket[first : last + 1])
                self.unfilled.append(last + 1 - first)
                self.order.append((k, start, end))
                first = last + 1
            self.last_of_bucket.append(len(self.order) - 1)
        self.posted = 0  # chunks handed out so far, a prefix of `order`

    def filled(self, name: str) -> list[tuple[int, int, int]]:
        """`name` is packed: the chunks that may go on the wire now, in order."""
        self.unfilled[self.chunk_of[name]] -= 1
        start = self.posted
        while self.posted < len(self.order) and self.unfilled[self.posted] == 0:
            self.posted += 1
        return self.order[start : self.posted]

    def all_posted(self, bucket: int | None = None) -> bool:
        """Every chunk (of buckets up to `bucket`, or of all) handed out."""
        last = len(self.order) - 1 if bucket is None else self.last_of_bucket[bucket]
        return self.posted > last


def two_staging(buckets: list[list[BucketEntry]], device: torch.device) -> list[torch.Tensor]:
    """Two alternating staging buffers (bucket k in buffer k % 2), each as large as its largest bucket; one when
    there is one bucket."""
    sizes = [bucket_size(b) for b in buckets]
    return [torch.empty(max(sizes[i::2]), dtype=torch.uint8, device=device) for i in range(min(2, len(sizes)))]


def bind_engine_views(model: nn.Module, buckets: list[list[BucketEntry]], device: torch.device) -> list[torch.Tensor]:
    """Each engine parameter moves into its bucket's receive buffer, keeping its value; the buffers, one per bucket.
    Bucket by bucket: a parameter's old memory goes as soon as its bucket is bound (a group kept together shares one
    bucket), so the engine holds its weights plus one bucket at most, never two copies of the model."""
    params = dict(model.named_parameters())
    buffers = []
    with torch.no_grad():
        for bucket in buckets:
            buffer = torch.empty(bucket_size(bucket), dtype=torch.uint8, device=device)
            for e in bucket:
                view = entry_view(buffer, e)
                view.copy_(params[e.name].data)
                params[e.name].data = view
            buffers.append(buffer)
    return buffers


def check_engine_matches(model: nn.Module, params: list[list[Any]]) -> None:
    """The engine's parameters have the actor's names and shapes ([name, shape] pairs; one clear error before any
    bucket is bound)."""
    mine = {n: list(p.shape) for n, p in model.named_parameters()}
    theirs = {n: list(s) for n, s, *_ in params}
    if mine != theirs:
        missing = sorted(set(theirs) - set(mine))[:3]
        extra = sorted(set(mine) - set(theirs))[:3]
        shape = [f"{n} (engine {mine[n]}, actor {theirs[n]})" for n in theirs if n in mine and mine[n] != theirs[n]][:3]
        raise RlrunError(
            f"weight sync: the engine model does not match the actor (missing on engine: {missing}, "
            f"only on engine: {extra}, shape differs: {shape}); both must load the same architecture"
        )
