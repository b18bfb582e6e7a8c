"""Sequence packing (--packing_samples): the real tokens of several rollout sequences share one row,
with no padding between them (pure tensor code, no model, no collectives).

A RolloutBatch row is `[left pad | prompt | response | right pad]`. Packed, sequence i is its
`prompt_len[i] + response_len[i]` real tokens, placed whole into one packed row after the sequences
placed there before it; its position ids restart at 0, which is what tells transformers (given no
2-D attention mask and no cache) to build a block-diagonal causal mask on sdpa/eager, or to run the
varlen kernel on flash-attention (one row only). The tail of a row, if any, is pad tokens whose
positions also restart at 0, so they form a block of their own that no real token attends to.

Per-token model outputs come back as one flat vector over every packed position; `PackedBatch`
knows which flat positions hold what, and scatters them back to the padded `[b, R]` response layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlrun.data.rollout import RolloutBatch


@dataclass(frozen=True)
class PackedBatch:
    """b sequences packed into n rows of width W; N = total response tokens (sum of response_len).

    input_ids:    [n, W] long
    position_ids: [n, W] long, restarting at 0 for each sequence (and for a row's tail padding)
    pred_index:   [N] long, ascending flat index (row * W + col) of the token BEFORE each response
                  token: the logits / value read for that response token
    out_row, out_col: [N] long, where that response token lives in the [b, R] layout
    last_index:   [b] long, flat index of each sequence's last real token
    source:       [n, W] long, flat index (row * L + column) into the [b, L] batch of each packed token, -1 on
                  a row's tail padding (what per-token inputs such as MoE routing follow)
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    pred_index: torch.Tensor
    out_row: torch.Tensor
    out_col: torch.Tensor
    last_index: torch.Tensor
    num_sequences: int
    response_width: int
    rows: tuple[tuple[int, ...], ...] = ()  # each packed row's sequences, in order (vision inputs follow it)
    source: torch.Tensor | None = None

    def keep_mask(self) -> torch.Tensor:
        """[n, W] bool, True at pred_index: the vocab projection then runs on exactly those N positions, in
        pred_index order (row-major), so the vocab projection runs only where a log-prob is needed."""
        mask = torch.zeros(self.input_ids.numel(), dtype=torch.bool, device=self.input_ids.device)
        mask[self.pred_index] = True
        return mask.view_as(self.input_ids)

    def targets(self) -> torch.Tensor:
        """[N] long: the response tokens, in pred_index order."""
        return self.input_ids.reshape(-1)[self.pred_index + 1]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[N] values in pred_index order -> [b, R], zero where there is no response token.

        Differentiable (index_put into a fresh zero tensor)."""
        out = values.new_zeros(self.num_sequences, self.response_width)
        return out.index_put((self.out_row, self.out_col), values)


def assign_rows(lengths: list[int], capacity: int | None) -> list[list[int]]:
    """First-fit decreasing: sequence indices per packed row, each row's total length <= capacity
    (capacity None: all in one row). Ties keep index order, so the result is deterministic.
    Zero-length sequences are not placed."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: (-lengths[i], i))
    if capacity is None:
        return [order] if order else []
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in order:
        if lengths[i] > capacity:
            raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than the packing capacity {capacity}")
        for r, used in enumerate(fill):
            if used + lengths[i] <= capacity:
                rows[r].append(i)
                fill[r] += lengths[i]
                break
        else:
            rows.append([i])
            fill.append(lengths[i])
    return rows


def pack_batch(batch: RolloutBatch, capacity: int | None, pad_id: int = 0, width_multiple: int = 1) -> PackedBatch:
    """Pack every sequence of `batch` (on any device; the result is on the same one).

    capacity: the most tokens per packed row, at least the longest sequence; None packs all into ONE
    row (flash-attention's varlen path needs batch size 1). A sequence whose prompt is empty has no
    token before its first response token: that token's entry is left out (it scatters back as 0).
    width_multiple: the row width is rounded up to a multiple of it (sequence parallelism splits the columns);
    the added columns are tail padding like any other.
    """
    seqs = batch.sequences
    device = seqs.device
    R = batch.response_width
    P = seqs.shape[1] - R
    prompt_len = batch.prompt_len.tolist()
    response_len = batch.response_len.tolist()
    lengths = [p + r for p, r in zip(prompt_len, response_len)]
    rows = assign_rows(lengths, capacity)
    width = max((sum(lengths[i] for i in row) for row in rows), default=1)
    width = -(-width // width_multiple) * width_multiple
    ids = torch.full((max(len(rows), 1), width), pad_id, dtype=torch.long, device=device)
    pos = torch.zeros_like(ids)
    source = torch.full_like(ids, -1)
    ar = torch.arange(width, device=device)
    start = [0] * len(lengths)
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            n = lengths[i]
            ids[r, col : col + n] = seqs[i, P - prompt_len[i] : P + response_len[i]]
            pos[r, col : col + n] = ar[:n]
            source[r, col : col + n] = i * seqs.shape[1] + P - prompt_len[i] + ar[:n]
            start[i] = r * width + col
            col += n
        pos[r, col:] = ar[: width - col]
    pred: list[int] = []
    out_row: list[int] = []
    out_col: list[int] = []
    for i, (p, n_resp) in enumerate(zip(prompt_len, response_len)):
        first = 0 if p > 0 else 1
        pred.extend(range(start[i] + p - 1 + first, start[i] + p - 1 + n_resp))
        out_row.extend([i] * (n_resp - first))
        out_col.extend(range(first, n_resp))
    pred_index = torch.tensor(pred, dtype=torch.long)
    order = torch.argsort(pred_index, stable=True)
    last = [start[i] + lengths[i] - 1 if lengths[i] > 0 else 0 for i in range(len(lengths))]
    return PackedBatch(
        input_ids=ids,
        position_ids=pos,
        pred_index=pred_index[order].to(device),
        out_row=torch.tensor(out_row, dtype=torch.long)[order].to(device),
        out_col=torch.tensor(out_col, dtype=torch.long)[order].to(device),
        last_index=torch.tensor(last, dtype=torch.long, device=device),
        num_sequences=len(lengths),
        response_width=R,
        rows=tuple(tuple(row) for row in rows),
        source=source,
    )
