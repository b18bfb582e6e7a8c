"""What the weight sync sends: the actor's parameters, grouped by FSDP unit in gather order (a thin adapter over the
actor's strategy, rlrun.strategies.blocks), or, for a LoRA actor, the merged weights under the base model's names, or
its adapters alone (for an engine that runs them beside its base weights)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from rlrun.models.lora import hf_name, is_adapter, lora_pairs, merge_into, merged_weight
from rlrun.strategies.blocks import (
    FullBlock,
    GatherScratch,
    Holding,
    NotHeldInSpans,
    ParamBlock,
    ParamHoming,
    local_data_ptr,
)


class ParamSource:
    """The actor's parameters, grouped by FSDP unit in gather order (a thin adapter over the strategy), and,
    when the strategy can (`homing`), moved into the sync's send buckets so the root sends them without a copy."""

    def __init__(
        self,
        model: nn.Module,
        param_blocks: Callable[[nn.Module], list[ParamBlock]],
        homing: ParamHoming | None = None,
    ) -> None:
        self.model = model
        self._param_blocks = param_blocks
        self._homing = homing
        self._held: tuple[tuple[Any, ...], list[Holding]] | None = None

    def zero_copy_blocker(self, dtype: torch.dtype, device: torch.device) -> str | None:
        """Why the root cannot send the parameters' own memory (None: it can, after `home`)."""
        if self._homing is None:
            return "the actor's strategy offers no re-homing"
        return self._homing.zero_copy_blocker(self.model, dtype, device)

    def home(self, views: Mapping[str, torch.Tensor]) -> None:
        """Each named parameter takes its view's memory (keeping its value)."""
        assert self._homing is not None
        self._homing.home_params(self.model, views)

    def blocks(self) -> list[ParamBlock]:
        """Each block's gather() is collective over the actor group."""
        return self._param_blocks(self.model)

    def holdings(self, replicas: tuple[int, ...]) -> list[Holding]:
        """What this rank holds of each parameter, in gather order (no collective): what it sends when every actor
        rank sends its own part (rlrun.weight_sync.senders). `replicas`: the actor's ranks. Kept while the parts stay
        where they are (a wake from --sleep, a load, moves them: then described again)."""
        key = (replicas, *(local_data_ptr(p) for p in self.model.parameters()))
        if self._held is None or self._held[0] != key:
            self._held = (key, [h for block in self.blocks() for h in block.holdings(replicas)])
        return self._held[1]

    def senders_blocker(self, replicas: tuple[int, ...]) -> str | None:
        """Why the actor's ranks cannot each send their own part (None: they can)."""
        try:
            self.holdings(replicas)
        except NotHeldInSpans as e:
            return str(e)
        return None

    def shapes(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        """(name, full shape, dtype) in gather order (no collective)."""
        return [s for block in self.blocks() for s in block.shapes()]

    def full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, new full tensor) in gather order. Collective: every actor rank must iterate to the end."""
        scratch = GatherScratch()
        for block in self.blocks():
            full = block.gather(scratch)
            for name in full.names:
                yield name, full.full(name)


# ---- LoRA-merged sources -----------------------------------------------------------------------------------------
# What a LoRA actor sends the generation engines: the merged weights (base + scaling * B @ A) under the base model's
# names, one FSDP unit at a time like a full actor's, so every engine backend (native, HF, vLLM) loads them unchanged.
#
# verl's issue 7495 (a LoRA sync that silently sent nothing) is why the weight sync checks what arrived: the merged
# tensors named by `check_names` are summed on both sides (rlrun.weight_sync.wire.verify).


class MergedFull:
    """A gathered unit of a PEFT model seen as the merged base model's parameters (hf names)."""

    def __init__(self, inner: FullBlock, scaling: float, pairs: dict[str, tuple[str, str]]) -> None:
        self.inner, self.scaling = inner, scaling
        self._peft = {hf_name(n): n for n in inner.names if not is_adapter(n)}
        self._pairs = pairs
        self.names = list(self._peft)

    def full(self, name: str) -> torch.Tensor:
        peft = self._peft[name]
        base = self.inner.full(peft)
        if peft not in self._pairs:
            return base
        a, b = self._pairs[peft]
        return merged_weight(base, self.inner.full(a), self.inner.full(b), self.scaling)

    def write(self, name: str, dest: torch.Tensor) -> torch.Tensor:
        """The merged weight into `dest` (the engine's parameter, or a send bucket's view) with no full-size
        temporary: the base written as it is, then the adapter's product added in place. `full` gives the same
        bits for a tensor of dest's dtype (the sync's check relies on it)."""
        peft = self._peft[name]
        self.inner.write(peft, dest)
        if peft in self._pairs:
            a, b = self._pairs[peft]
            merge_into(dest, self.inner.full(a), self.inner.full(b), self.scaling)
        return dest

    def aliases(self, name: str, dest: torch.Tensor) -> bool:
        return False  # a merged weight is computed, never the actor's own memory


class MergedBlock:
    """One FSDP unit of a PEFT model: gathers as the unit does, yields merged weights. A LoRA layer's base weight and
    adapters sit in the same unit (the decoder layer), so each unit merges on its own."""

    def __init__(self, inner: ParamBlock, scaling: float) -> None:
        self.inner, self.scaling = inner, scaling
        self._pairs = lora_pairs([n for n, _ in inner.named])

    def shapes(self) -> list[tuple[str, torch.Size, torch.dtype]]:
        return [(hf_name(n), s, d) for n, s, d in self.inner.shapes() if not is_adapter(n)]

    def gather(self, scratch: GatherScratch | None = None) -> MergedFull:
        return MergedFull(self.inner.gather(scratch), self.scaling, self._pairs)


class MergedLoraParams(ParamSource):
    """The LoRA actor as the weight sync's source: merged weights, packed into the send buckets (never zero-copy)."""

    def __init__(self, model: nn.Module, param_blocks: Callable[[nn.Module], list[ParamBlock]], scaling: float) -> None:
        super().__init__(model, param_blocks, None)
        self.scaling = scaling

    def zero_copy_blocker(self, dtype: torch.dtype, device: torch.device) -> str | None:
        return "LoRA: the engines get base + adapter merged, computed per unit"

    def senders_blocker(self, replicas: tuple[int, ...]) -> str | None:
        return "LoRA: a merged weight needs a unit's whole adapters, so the actor's first rank merges and sends"

    def blocks(self) -> list[MergedBlock]:  # type: ignore[override]
        return [MergedBlock(b, self.scaling) for b in self._param_blocks(self.model)]

    def check_names(self) -> list[str]:
        """Merged weights the sync verifies on the engines: the first and last adapted layer's (cheap, and a sync
        that skipped the adapters, or sent the base alone, changes neither)."""
        adapted = [
            hf_name(base) for b in self._param_blocks(self.model) for base in lora_pairs([n for n, _ in b.named])
        ]
        return list(dict.fromkeys(adapted[:1] + adapted[-1:]))


# ---- LoRA adapters alone -----------------------------------------------------------------------------------------
# For an engine that keeps the base weights it loaded and runs the adapters beside them (rlrun.engines.receivers
# .KeptAdapters): each sync sends lora_A and lora_B only (0.5-5 % of the weights), under the base model's module names.


class AdapterParams(ParamSource):
    """The LoRA actor's adapters as the weight sync's source (hf names: `model.layers.0.self_attn.q_proj.lora_A
    .default.weight`), gathered per FSDP unit like the rest and sent from the actor's first rank."""

    def __init__(self, model: nn.Module, param_blocks: Callable[[nn.Module], list[ParamBlock]]) -> None:
        super().__init__(model, lambda m: _adapters_only(param_blocks(m)), None)

    def zero_copy_blocker(self, dtype: torch.dtype, device: torch.device) -> str | None:
        return "LoRA adapters: packed from their FSDP units"

    def senders_blocker(self, replicas: tuple[int, ...]) -> str | None:
        return "LoRA adapters: a few MiB, sent from the actor's first rank"

    def check_names(self) -> list[str]:
        """Adapters the sync verifies on the engines: the first and last B (zero until trained: a sync that sent
        nothing leaves the engine's at zero)."""
        names = [n for n, _, _ in self.shapes() if ".lora_B." in n]
        return list(dict.fromkeys(names[:1] + names[-1:]))


def _adapters_only(blocks: list[ParamBlock]) -> list[ParamBlock]:
    """Each unit's adapter parameters under hf names, as a block of the unit's own kind (its gather collective)."""
    kept = [type(b)([(hf_name(n), p) for n, p in b.named if is_adapter(n)]) for b in blocks]
    return [b for b in kept if b.named]
