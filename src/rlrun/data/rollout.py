"""The rollout batch and how it is packed for the wire (pure tensor code, no collectives).

On the wire every row has a fixed width: prompt left-padded to P = prompt_max_len, response
right-padded to R = generate_max_len, plus two length columns. After the gather every rank trims
to the longest real prompt and response of the step, so compute never pays for the fixed width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import torch

from rlrun.data.vision_batch import RowVision


@dataclass
class RolloutBatch:
    """Rows are ordered by (prompt, sample): rows i*n .. i*n+n-1 share prompt i.

    sequences:      [B, p + r] long, prompt left-padded to p, response right-padded to r
    attention_mask: [B, p + r] long, 1 on real tokens
    action_mask:    [B, r] float, 1 on response tokens the policy is trained on: every generated token (EOS
                    included); in multi-turn episodes 0 on the environment's observation tokens
    prompt_len, response_len: [B] long
    engine_log_probs: [B, r] float or None, the engine's log-prob of each sampled response token (0 on padding)
    vision:         the rows' prompt images (vision-language policies), None for text
    routing:        [B, p + r, layers, k] uint8 or None, the experts the engine routed each token to (a MoE policy
                    with --router_replay R3; rlrun.models.moe.NO_ROUTE where none was recorded)
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    prompt_len: torch.Tensor
    response_len: torch.Tensor
    engine_log_probs: torch.Tensor | None = None
    vision: RowVision | None = None
    routing: torch.Tensor | None = None

    @property
    def response_width(self) -> int:
        return self.action_mask.shape[1]

    def rows(self, index: slice | torch.Tensor) -> RolloutBatch:
        picked: dict[str, Any] = {f.name: _opt(getattr(self, f.name), lambda t: t[index]) for f in fields(self)}
        return RolloutBatch(**picked)

    def to(self, device: torch.device) -> RolloutBatch:
        moved: dict[str, Any] = {f.name: _opt(getattr(self, f.name), lambda t: t.to(device)) for f in fields(self)}
        return RolloutBatch(**moved)


_Field = TypeVar("_Field", torch.Tensor, RowVision)  # a batch field's value


def _opt(t: _Field | None, fn: Callable[[_Field], _Field]) -> _Field | None:
    return None if t is None else fn(t)


def pack_rows(
    prompts: list[list[int]], responses: list[list[int]], prompt_width: int, response_width: int, pad_id: int
) -> torch.Tensor:
    """Token lists -> [b, P + R + 2] long: left-padded prompt | right-padded response | lengths."""
    b = len(prompts)
    out = torch.full((b, prompt_width + response_width + 2), pad_id, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if len(p) > prompt_width or len(r) > response_width:
            raise ValueError(f"row {i}: prompt {len(p)} > {prompt_width} or response {len(r)} > {response_width}")
        if p:
            out[i, prompt_width - len(p) : prompt_width] = torch.tensor(p)
        if r:
            out[i, prompt_width : prompt_width + len(r)] = torch.tensor(r)
        out[i, -2] = len(p)
        out[i, -1] = len(r)
    return out


def unpack_rows(packed: torch.Tensor, prompt_width: int) -> RolloutBatch:
    """[B, P + R + 2] -> RolloutBatch trimmed to the longest real prompt and response."""
    prompt_len, response_len = packed[:, -2], packed[:, -1]
    p = int(prompt_len.max())
    r = max(int(response_len.max()), 1)
    sequences = torch.cat(
        [packed[:, prompt_width - p : prompt_width], packed[:, prompt_width : prompt_width + r]], dim=1
    )
    cols_p = torch.arange(p, device=packed.device)
    cols_r = torch.arange(r, device=packed.device)
    prompt_mask = cols_p[None, :] >= (p - prompt_len)[:, None]
    action_mask = cols_r[None, :] < response_len[:, None]
    attention_mask = torch.cat([prompt_mask, action_mask], dim=1).long()
    return RolloutBatch(
        sequences.clone(), attention_mask, action_mask.float(), prompt_len.clone(), response_len.clone()
    )


def response_tokens(batch: RolloutBatch) -> list[list[int]]:
    r = batch.response_width
    return [row[-r:][: int(n)].tolist() for row, n in zip(batch.sequences, batch.response_len)]


def pack_log_probs(log_probs: Sequence[Sequence[float]], response_width: int) -> torch.Tensor:
    """Per-row token values (log-probs, action masks) -> [b, R] float32, right-padded with 0 (the wire twin
    of pack_rows)."""
    out = torch.zeros((len(log_probs), response_width), dtype=torch.float32)
    for i, row in enumerate(log_probs):
        if len(row) > response_width:
            raise ValueError(f"row {i}: {len(row)} values > {response_width}")
        if row:
            out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def engine_logprob_diff(batch: RolloutBatch, actor_log_probs: torch.Tensor) -> dict[str, float]:
    """{"rollout/engine_vs_actor_logprob_diff": mean |engine - actor| over response tokens}, or {} when
    the batch carries no engine log-probs. actor_log_probs: [B, r], same temperature as sampling."""
    if batch.engine_log_probs is None:
        return {}
    mask = batch.action_mask
    diff = (batch.engine_log_probs.float() - actor_log_probs.float()).abs() * mask
    return {"rollout/engine_vs_actor_logprob_diff": float(diff.sum() / mask.sum().clamp(min=1))}


# ---- result slots ------------------------------------------------------------------------------------------------
# Packing per-role results into one flat vector per rank, so ONE all-gather returns every
# role's outputs (old log-probs, ref log-probs, values, reward-model scores) to every rank.


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
class SlotLayout:
    slots: tuple[Slot, ...]
    total: int


def slot_layout(num_rows: int, widths: dict[str, int], ranks: dict[str, tuple[int, ...]]) -> SlotLayout:
    """widths/ranks keyed by result name, e.g. {"old_log_probs": R, "scores": 1}."""
    slots, offset = [], 0
    for key, width in widths.items():
        slot = Slot(key, ranks[key], num_rows // len(ranks[key]), width, offset)
        slots.append(slot)
        offset += slot.size
    return SlotLayout(tuple(slots), offset)


def pack_slots(plan: SlotLayout, rank: int, values: dict[str, torch.Tensor]) -> torch.Tensor:
    """This rank's results ([rows_per_rank, width] each, for the roles it holds) -> [total]."""
    flat = torch.zeros(plan.total, dtype=torch.float32)
    for slot in plan.slots:
        if rank in slot.ranks:
            flat[slot.offset : slot.offset + slot.size] = values[slot.key].reshape(-1).float()
    return flat


def unpack_slots(
    plan: SlotLayout, gathered: torch.Tensor, group_ranks: Sequence[int] | None = None
) -> dict[str, torch.Tensor]:
    """[group size, total] -> {key: [num_rows, width]} (scores come back as [num_rows]). Row i of `gathered`
    is global rank group_ranks[i] (default: the world, row = rank)."""
    row = {r: i for i, r in enumerate(group_ranks)} if group_ranks is not None else None
    out = {}
    for slot in plan.slots:
        parts = [
            gathered[row[r] if row is not None else r, slot.offset : slot.offset + slot.size].view(
                slot.rows_per_rank, slot.width
            )
            for r in slot.ranks
        ]
        full = torch.cat(parts)
        out[slot.key] = full.squeeze(1) if slot.width == 1 else full
    return out
