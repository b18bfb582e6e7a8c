"""Which rows each rank handles: pure index arithmetic shared by every role."""

from __future__ import annotations

import hashlib

import torch


def shard(num_rows: int, num_shards: int, index: int) -> slice:
    """Contiguous equal share `index` of `num_shards` (callers check divisibility up front)."""
    size = num_rows // num_shards
    return slice(index * size, (index + 1) * size)


def derive_seed(*parts: int | str) -> int:
    """A stable 63-bit seed from parts (Python's hash() is salted per process)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def minibatch_order(num_rows: int, mini_batch: int, seed: int) -> list[torch.Tensor]:
    """A shuffled split of range(num_rows) into mini-batches, identical on every rank."""
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed))
    return list(perm.split(mini_batch))
