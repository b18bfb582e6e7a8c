"""The delta encoding of rlrun.weight_sync.delta on its own (no process group): what changed travels as 16-bit gaps
and values, decodes to the same positions, and writes the new stripe exactly; the dense fallback; the checksum."""

from __future__ import annotations

import torch

from rlrun.engines.receivers import entry_view, pack_buckets
from rlrun.weight_sync.delta import GAP, apply_changes, changes, checksum, positions

BF16 = torch.bfloat16


def test_changes_decode_to_the_changed_positions_across_gaps_wider_than_16_bits():
    last = torch.randn(3 * GAP + 17).to(BF16)
    new = last.clone()
    changed = [0, 5, GAP + 3, 3 * GAP + 16]  # a gap of almost two GAPs between the 3rd and the 4th
    new[changed] += 1
    found = changes(new, last)
    assert found is not None
    gaps, values = found
    assert gaps.dtype == torch.int16 and values.dtype == BF16
    where = positions(gaps)
    # the changed elements, and every GAP-th one (sent unchanged so that no gap outgrows 16 bits)
    assert sorted(set(changed) | {GAP - 1, 2 * GAP - 1, 3 * GAP - 1}) == where.tolist()
    assert torch.equal(values, new[where])
    assert gaps.numel() * 4 < 0.01 * new.numel() * 2  # 4 bytes per sent element


def test_bits_not_values_decide_what_changed_and_a_mostly_changed_stripe_goes_dense():
    last = torch.tensor([0.0, 1.0, float("nan"), 2.0], dtype=BF16)
    new = torch.tensor([-0.0, 1.0, float("nan"), 2.0], dtype=BF16)  # -0.0 == 0.0, but its bits differ
    gaps_values = changes(torch.cat([new, last.repeat(10)]), torch.cat([last, last.repeat(10)]))
    assert gaps_values is not None and positions(gaps_values[0]).tolist() == [0]
    assert changes(last + 1, last) is None  # every element changed: the pairs are larger than the stripe


def test_applied_changes_leave_the_bucket_equal_to_the_new_stripe_and_its_checksum():
    """A stripe made of pieces of three entries of one bucket (as many senders lays them out), updated in place."""
    shapes = [("a", torch.Size([5, 3]), BF16), ("b", torch.Size([7]), BF16), ("c", torch.Size([4, 4]), BF16)]
    bucket = pack_buckets(shapes, 1 << 20)[0]
    pieces = ((bucket[0], 6, 15), (bucket[1], 0, 7), (bucket[2], 2, 9))  # a rank's rows of a, all of b, part of c
    buffer = torch.zeros(bucket[-1].offset + 64, dtype=torch.uint8)
    stripe_last = torch.randn(9 + 7 + 7).to(BF16)
    at = 0
    for e, begin, end in pieces:
        entry_view(buffer, e).view(-1)[begin:end] = stripe_last[at : at + end - begin]
        at += end - begin
    before = buffer.clone()
    stripe_new = stripe_last.clone()
    stripe_new[[0, 8, 9, 22]] *= 3  # the first and last element of a piece, a piece's first, the stripe's last
    gaps, values = changes(stripe_new, stripe_last)
    apply_changes(buffer, pieces, positions(gaps), values)
    got = torch.cat([entry_view(buffer, e).view(-1)[begin:end] for e, begin, end in pieces])
    assert torch.equal(got, stripe_new)
    assert sum(checksum(entry_view(buffer, e).view(-1)[b:end]) for e, b, end in pieces) == checksum(stripe_new)
    assert checksum(stripe_new) != checksum(stripe_last)
    outside = torch.ones_like(buffer, dtype=torch.bool)  # nothing outside the pieces was written
    for e, begin, end in pieces:
        outside[e.offset + 2 * begin : e.offset + 2 * end] = False
    assert torch.equal(buffer[outside], before[outside])
