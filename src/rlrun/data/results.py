"""Packing per-role results into one flat vector per rank, so ONE all-gather returns every
role's outputs (old log-probs, ref log-probs, values, reward-model scores) to every rank."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Slot:
    key: str
    ranks: tuple[int, ...]  # the role's ranks; rank ranks[j] computes rows shard j
    rows_per_rank: int
    width: int
    offset: int  # into the flat vector

    @property
    def size(self) -> int:
        return self.rows_per_rank * self.width


@dataclass(frozen=True)
class SlotPlan:
    slots: tuple[Slot, ...]
    total: int


def slot_plan(num_rows: int, widths: dict[str, int], ranks: dict[str, tuple[int, ...]]) -> SlotPlan:
    """widths/ranks keyed by result name, e.g. {"old_log_probs": R, "scores": 1}."""
    slots, offset = [], 0
    for key, width in widths.items():
        slot = Slot(key, ranks[key], num_rows // len(ranks[key]), width, offset)
        slots.append(slot)
        offset += slot.size
    return SlotPlan(tuple(slots), offset)


def pack_slots(plan: SlotPlan, rank: int, values: dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's results ([rows_per_rank, width] each, for the roles it holds) -> [total]."""
    flat = torch.zeros(plan.total, dtype=torch.float32)
    for slot in plan.slots:
        if rank in slot.ranks:
            flat[slot.offset:slot.offset + slot.size] = values[slot.key].reshape(-1).float()
    return flat


def unpack_slots(plan: SlotPlan, gathered: torch.Tensor, group_ranks: Sequence[int] | None = None
                 ) -> dict[str, torch.Tensor]:
    """[group size, total] -> {key: [num_rows, width]} (scores come back as [num_rows]). Row i of `gathered`
    is global rank group_ranks[i] (default: the world, row = rank)."""
    row = {r: i for i, r in enumerate(group_ranks)} if group_ranks is not None else None
    out = {}
    for slot in plan.slots:
        parts = [gathered[row[r] if row is not None else r, slot.offset:slot.offset + slot.size]
                 .view(slot.rows_per_rank, slot.width) for r in slot.ranks]
        full = torch.cat(parts)
        out[slot.key] = full.squeeze(1) if slot.width == 1 else full
    return out
