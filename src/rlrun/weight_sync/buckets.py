"""The sender's side of weight sync's buckets: the order chunks go on the wire in, and the staging buffers (the
bucket format and the engines' receivers: rlrun.engines.receivers)."""

from __future__ import annotations

import torch

from rlrun.engines.receivers import BucketEntry, bucket_size


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
