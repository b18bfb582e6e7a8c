"""Checkpoint names -> a model's parameter names by transformers' own conversion rules (renames, and MoE experts
stored per expert, stacked into fused tensors), and `Converted`, a weight source read through them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlrun.models.weights import Rows, WeightSource

# Checkpoint names -> the model's parameter names, by transformers' own conversion rules for the model's class (its
# conversion mapping: e.g. Qwen2-VL's hub checkpoints keep `visual.*` and `model.layers.*`, which transformers 5
# builds as `model.visual.*` and `model.language_model.layers.*`). Beyond renames, one conversion is read too: MoE
# experts stored one tensor per expert (`mlp.experts.3.gate_proj.weight`, Mixtral's `experts.3.w1.weight`), which
# transformers 5 stacks into one fused parameter per layer (`mlp.experts.gate_up_proj` [E, 2I, H], the gate and up
# projections concatenated along dim 1; `down_proj` [E, H, I]). A rank then reads only its experts' tensors. Other
# conversions keep rlrun's whole-model fallback. The one place rlrun reads transformers' loading internals.


@dataclass(frozen=True)
class Merge:
    """A parameter transformers builds from per-expert tensors: `parts[j][e]` is expert e's stored tensor of the
    converter's j-th source pattern; each pattern's experts are stacked (dim 0) and the patterns concatenated along
    dim 1 (MergeModulelist(dim=0), then Concatenate(dim=1) when there are several)."""

    parts: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Conversions:
    """How the stored names map onto a model: `names` {parameter: stored name} (renames), `merges` {parameter:
    Merge} (experts stacked)."""

    names: dict[str, str]
    merges: dict[str, Merge]


def _conversion_rules(model: nn.Module) -> list[Any]:
    """transformers' conversion mapping for `model`'s class ([] when this transformers has no such API or none)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: PLC0415

        return list(get_model_conversion_mapping(model))  # type: ignore[arg-type]  # any model: see the except
    except (ImportError, AttributeError, TypeError, ValueError):
        return []


def _expert_converters(rules: list[Any]) -> list[Any]:
    """The rules rlrun reads itself: per-expert tensors stacked (MergeModulelist(dim=0)), then, for several source
    patterns, concatenated along dim 1."""
    from transformers.core_model_loading import WeightConverter  # noqa: PLC0415 - only reached with rules

    def stacks(converter: Any) -> bool:
        kinds = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
        several = len(converter.source_patterns) > 1
        return kinds == ([("MergeModulelist", 0), ("Concatenate", 1)] if several else [("MergeModulelist", 0)])

    return [c for c in rules if isinstance(c, WeightConverter) and stacks(c)]


def conversions(model: nn.Module, stored: Iterable[str]) -> Conversions:
    """What transformers' conversion mapping for `model` makes of the stored names (nothing when this transformers
    has no conversion mapping API or converts nothing rlrun reads)."""
    rules = _conversion_rules(model)
    if not rules:
        return Conversions({}, {})
    from transformers.core_model_loading import WeightRenaming, rename_source_key  # noqa: PLC0415

    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = _expert_converters(rules)
    if not renamings and not converters:
        return Conversions({}, {})
    params = dict(model.named_parameters())
    prefix = getattr(model, "base_model_prefix", None)
    names: dict[str, str] = {}
    groups: dict[str, dict[int, list[str]]] = {}
    for name in stored:
        target, pattern = rename_source_key(name, renamings, converters, prefix, params)
        if target not in params:
            continue
        if pattern is None:
            if target != name:
                names[target] = name
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        groups.setdefault(target, {}).setdefault(converter.source_patterns.index(pattern), []).append(name)
    merges = {}
    for target, by_pattern in groups.items():
        parts = tuple(tuple(sorted(by_pattern[j], key=_numbers)) for j in sorted(by_pattern))
        if len({len(p) for p in parts}) == 1:  # else some experts are missing: `missing` reports the parameter
            merges[target] = Merge(parts)
    return Conversions(names, merges)


def per_expert_names(model: nn.Module) -> set[str]:
    """The module names transformers' conversion mapping gives one expert's tensors in a checkpoint (gate_proj,
    up_proj, down_proj; Mixtral's w1, w2, w3): PEFT reads a LoRA target of such a name as the fused routed experts."""
    rules = _conversion_rules(model)
    patterns = [p for c in _expert_converters(rules) for p in c._original_source_patterns] if rules else []
    return {p.split("*.")[-1].removesuffix(".weight") for p in patterns if "*." in p}


def _numbers(name: str) -> tuple[int, ...]:
    """The integers in a stored name, in order: per-expert names of one layer differ only in the expert's."""
    return tuple(int(part) for part in name.split(".") if part.isdigit())


def model_names(model: nn.Module, stored: Iterable[str]) -> dict[str, str]:
    """{parameter name: stored name} for the stored names transformers' renamings map onto `model`'s parameters
    ({} when this transformers has no conversion mapping API or renames nothing)."""
    return conversions(model, stored).names


class Converted:
    """`source` read under the model's parameter names (conversions): renamed ones by their
    stored names, merged experts stacked from their per-expert tensors (rows: the experts [begin, end) only)."""

    def __init__(self, source: WeightSource, found: Conversions) -> None:
        self.source, self.names, self.merges = source, found.names, found.merges

    def shape(self, name: str) -> tuple[int, ...] | None:
        merge = self.merges.get(name)
        if merge is None:
            return self.source.shape(self.names.get(name, name))
        found = [self.source.shape(part[0]) for part in merge.parts]
        firsts = [f for f in found if f is not None]
        if len(firsts) != len(found) or any(f[1:] != firsts[0][1:] for f in firsts):
            return None
        return (len(merge.parts[0]), sum(f[0] for f in firsts), *firsts[0][1:])

    def read(self, name: str, rows: Rows | None) -> torch.Tensor:
        merge = self.merges.get(name)
        if merge is None:
            return self.source.read(self.names.get(name, name), rows)
        begin, end = rows or (0, len(merge.parts[0]))
        experts = [torch.cat([self.source.read(part[e], None) for part in merge.parts]) for e in range(begin, end)]
        return torch.stack(experts)
