"""The vision inputs of rollout rows (pure tensor code, no collectives).

Rows of one prompt share its images: a batch keeps one entry per prompt (its pixel patches and image grids) and
each row points at its entry, so images cross ranks once per prompt, not once per sample, and a micro-batch's model
inputs repeat an entry only for the rows it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PromptVision:
    """One prompt's images as the image processor gives them.

    pixel_values: [patches, D] float32 (D = channels x temporal patch x patch x patch)
    grid_thw:     [images, 3] long, each image's (temporal, height, width) patch grid
    images:       the decoded images themselves, on the rank that read them only (vLLM preprocesses its own);
                  never sent nor saved
    """

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    images: tuple[Any, ...] = ()

    @classmethod
    def empty(cls, dim: int) -> PromptVision:
        return cls(torch.zeros(0, dim), torch.zeros(0, 3, dtype=torch.long))


@dataclass(frozen=True)
class RowVision:
    """entries: the batch's prompts' images; row_entry: [B] long, the entry of each row."""

    entries: tuple[PromptVision, ...]
    row_entry: torch.Tensor

    @classmethod
    def of_rows(cls, per_row: list[PromptVision]) -> RowVision:
        """One entry per distinct object in `per_row` (rows of one prompt pass the same PromptVision)."""
        index: dict[int, int] = {}
        entries: list[PromptVision] = []
        rows = []
        for vision in per_row:
            if id(vision) not in index:
                index[id(vision)] = len(entries)
                entries.append(vision)
            rows.append(index[id(vision)])
        return cls(tuple(entries), torch.tensor(rows, dtype=torch.long))

    def __len__(self) -> int:
        return int(self.row_entry.numel())

    def __getitem__(self, index: slice | torch.Tensor | list[int]) -> RowVision:
        """The rows `index` selects (as a tensor's rows), sharing this batch's entries."""
        return RowVision(self.entries, self.row_entry[index])

    def to(self, device: torch.device) -> RowVision:
        """Itself: entries stay on the host until model_inputs builds one micro-batch's tensors on the device."""
        return self

    def row(self, i: int) -> PromptVision:
        return self.entries[int(self.row_entry[i])]

    def row_images(self) -> list[tuple[Any, ...]]:
        """Each row's decoded images (where they were read: the engine ranks)."""
        return [self.entries[i].images for i in self.row_entry.tolist()]

    def grids(self) -> torch.Tensor | None:
        """[images, 3]: the rows' image grids in row order (None when no row has an image)."""
        rows = [self.entries[i].grid_thw for i in self.row_entry.tolist()]
        return torch.cat(rows) if any(g.shape[0] for g in rows) else None

    def model_inputs(self, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """{"pixel_values": [patches of every row, in row order, D], "image_grid_thw": [images, 3]} for the model's
        forward ({} when no row has an image)."""
        rows = [self.entries[i] for i in self.row_entry.tolist()]
        if not any(e.grid_thw.shape[0] for e in rows):
            return {}
        return {
            "pixel_values": torch.cat([e.pixel_values for e in rows]).to(device, dtype),
            "image_grid_thw": torch.cat([e.grid_thw for e in rows]).to(device),
        }

    # ---- wire and checkpoints: tensors only --------------------------------------------------------

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors only (checkpoints load them with weights_only=True; the wire sends the same)."""
        dim = self.entries[0].pixel_values.shape[1] if self.entries else 0
        return {
            "pixels": torch.cat([e.pixel_values for e in self.entries]) if self.entries else torch.zeros(0, dim),
            "grids": torch.cat([e.grid_thw for e in self.entries])
            if self.entries
            else torch.zeros(0, 3, dtype=torch.long),
            "images": torch.tensor([e.grid_thw.shape[0] for e in self.entries], dtype=torch.long),
            "row_entry": self.row_entry,
        }

    @classmethod
    def from_state(cls, state: dict[str, torch.Tensor]) -> RowVision:
        images = state["images"].tolist()
        grids = list(torch.split(state["grids"], images)) if images else []
        patches = [int(g.prod(dim=1).sum()) for g in grids]
        pixels = list(torch.split(state["pixels"], patches)) if patches else []
        entries = tuple(PromptVision(p, g) for p, g in zip(pixels, grids))
        return cls(entries, state["row_entry"])

    @classmethod
    def concat(cls, parts: list[RowVision]) -> RowVision:
        """The rows of `parts` in order (the engines' shares of a step)."""
        entries: list[PromptVision] = []
        rows = []
        for part in parts:
            rows.append(part.row_entry + len(entries))
            entries.extend(part.entries)
        return cls(tuple(entries), torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long))

    def digest(self) -> list[float]:
        """Per row, the sum of its prompt's pixels and grids: equal on every rank when the images arrived intact."""
        return [
            float(e.pixel_values.double().sum() + e.grid_thw.sum()) for e in (self.row(i) for i in range(len(self)))
        ]
