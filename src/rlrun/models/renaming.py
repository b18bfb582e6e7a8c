"""Checkpoint names -> the model's parameter names, by transformers' own renaming rules for the model's class (its
conversion mapping: e.g. Qwen2-VL's hub checkpoints keep `visual.*` and `model.layers.*`, which transformers 5 builds as
`model.visual.*` and `model.language_model.layers.*`). Only renames: a checkpoint that needs tensors converted
(fused, split) keeps rlrun's whole-model fallback. The one place rlrun reads transformers' loading internals."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def model_names(model: nn.Module, stored: Iterable[str]) -> dict[str, str]:
    """{parameter name: stored name} for the stored names transformers' renamings map onto `model`'s parameters
    ({} when this transformers has no conversion mapping API or renames nothing)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: PLC0415
        from transformers.core_model_loading import WeightRenaming, rename_source_key  # noqa: PLC0415
    except ImportError:
        return {}
    try:
        rules = get_model_conversion_mapping(model)
    except (AttributeError, TypeError, ValueError):
        return {}
    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    if not renamings:
        return {}
    params = dict(model.named_parameters())
    prefix = getattr(model, "base_model_prefix", None)
    out = {}
    for name in stored:
        renamed, _ = rename_source_key(name, renamings, [], prefix, params)
        if renamed in params and renamed != name:
            out[renamed] = name
    return out
