"""Lossless delta sync (--weight_sync_delta): what changed in a stripe since its last sync, and the check that an
engine's copy equals the actor's after applying it.

A stripe (rlrun.weight_sync.senders) is compared bit for bit with the copy of it its sender last sent (a weight that
moved by less than the wire dtype's resolution is not sent: it did not change on the wire either). The changed
elements travel as (gap, value) pairs, the gap from the previous changed element in 16 bits (every 65,535th element
is sent whether or not it changed, so that no gap is wider: a rewrite of its own value), and are written over the
engine's copy, so the result is exactly the dense sync's: 4 bytes per changed bf16 weight; when the pairs would be at
least as large as the stripe itself, the stripe goes dense. Every stripe
carries the checksum of its full new contents (the integer sum of its elements' bit patterns), which each engine rank
compares with what its own weights sum to after the update: an engine copy that drifted from the last sync (a missed
or corrupted update) is one clear error, never silently wrong weights.
"""

from __future__ import annotations

import torch

from rlrun.engines.receivers import BucketEntry

DENSE = -1  # a header's count when the whole stripe follows
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as integers of the same width (a view): equal bits, equal integers (NaN, -0.0 included)."""
    return t.view(_BITS[t.element_size()])


def checksum(t: torch.Tensor) -> int:
    """The sum of `t`'s bit patterns, exact (int64 accumulation, wrapping): any one changed element changes it."""
    return int(bits(t).sum(dtype=torch.int64))


GAP = 65535  # the widest gap a 16-bit field holds (stored as gap - 1)


def changes(new: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(gaps [n] int16, values [n]) of the elements of `new` [S] whose bits differ from `last` [S] (and of every
    GAP-th element: the gaps then fit 16 bits); None when sending them would take at least as many bytes as `new`
    itself (send it dense)."""
    differ = bits(new) != bits(last)
    differ[GAP - 1 :: GAP] = True
    count = int(differ.sum())
    if count * (2 + new.element_size()) >= new.numel() * new.element_size():
        return None
    index = differ.nonzero().view(-1)
    gaps = torch.diff(index, prepend=index.new_full((1,), -1)) - 1  # in [0, GAP - 1]
    return gaps.to(torch.int32).to(torch.int16), new[index]  # the int16 cast keeps the low 16 bits


def positions(gaps: torch.Tensor) -> torch.Tensor:
    """[n] int64 stripe positions from changes()' 16-bit gaps."""
    return torch.cumsum((gaps.to(torch.int64) & 0xFFFF) + 1, 0) - 1


def header(count: int, total: int, device: torch.device) -> torch.Tensor:
    """[2] int64: the changed elements that follow (DENSE: the whole stripe follows), the stripe's checksum."""
    return torch.tensor([count, total], dtype=torch.int64, device=device)


def apply_changes(
    buffer: torch.Tensor,
    pieces: tuple[tuple[BucketEntry, int, int], ...],
    index: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Write `values` [n] at stripe positions `index` [n] (int64, rising) into the bucket `buffer` (uint8), whose
    entries hold the stripe's `pieces` (entry, first element, end element) back to back."""
    if not index.numel():
        return
    sizes = torch.tensor([end - begin for _, begin, end in pieces], dtype=torch.int64, device=index.device)
    starts = torch.cumsum(sizes, 0) - sizes  # each piece's first position in the stripe
    itemsize = values.element_size()
    # a position's bucket element: its entry's first element + the piece's first element + its offset in the piece
    shift = (
        torch.tensor([e.offset // itemsize + begin for e, begin, _ in pieces], dtype=torch.int64, device=index.device)
        - starts
    )
    piece = torch.searchsorted(starts, index, right=True) - 1
    buffer.view(values.dtype)[index + shift[piece]] = values
