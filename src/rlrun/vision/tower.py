"""The vision tower of a vision-language model: what --freeze_visual_encoder keeps fixed."""

from __future__ import annotations

from torch import nn

from rlrun.models.conversions import model_names
from rlrun.runtime.errors import ConfigError

# Submodule names of the image encoder and its projector into the language model in transformers' VLM classes
# (Qwen2-VL/Qwen2.5-VL: `visual`, whose `merger` is the projector; LLaVA-style: vision_tower + multi_modal_projector).
VISION_MODULES = ("visual", "vision_tower", "vision_model", "multi_modal_projector")


def vision_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of the image encoder and its projector, by name."""
    out: dict[str, nn.Parameter] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in VISION_MODULES:
            out.update({f"{name}.{n}": p for n, p in module.named_parameters()})
    return out


def freeze_vision_tower(model: nn.Module) -> int:
    """requires_grad off for the vision tower and projector (as OpenRLHF's --freeze_visual_encoder: the language
    model alone trains); returns how many parameters were frozen. The optimizer then holds no state for them."""
    params = vision_parameters(model)
    if not params:
        raise ConfigError(
            f"--freeze_visual_encoder: {type(model).__name__} has no vision tower (none of the "
            f"submodules {', '.join(VISION_MODULES)}); it is for vision-language models"
        )
    for p in params.values():
        p.requires_grad_(False)
    return sum(p.numel() for p in params.values())


def freeze_by_prefix(model: nn.Module, prefixes: tuple[str, ...]) -> int:
    """OpenRLHF-M's --freeze_prefix (e.g. `visual`): requires_grad off for every parameter whose name starts with one
    of `prefixes`, under the model's own names or the checkpoint's (transformers 5 builds Qwen2-VL's `visual.*` as
    `model.visual.*`); returns how many parameters were frozen. A prefix that matches nothing is an error."""
    params = dict(model.named_parameters())
    stored = {name: name for name in params}
    stored.update(model_names(model, _checkpoint_names(model, params)))
    unmatched = [p for p in prefixes if not any(n.startswith(p) or stored[n].startswith(p) for n in params)]
    if unmatched:
        raise ConfigError(
            f"--freeze_prefix {' '.join(unmatched)} matches no parameter of {type(model).__name__} "
            f"(its names start like {', '.join(sorted({'.'.join(n.split('.')[:2]) for n in params if '.' in n})[:4])})"
        )
    frozen = [p for n, p in params.items() if any(n.startswith(x) or stored[n].startswith(x) for x in prefixes)]
    for p in frozen:
        p.requires_grad_(False)
    return sum(p.numel() for p in frozen)


def _checkpoint_names(model: nn.Module, params: dict[str, nn.Parameter]) -> list[str]:
    """The names a hub checkpoint of `model` stores (transformers' save-time reversal of its load-time renames)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion  # noqa: PLC0415
    except ImportError:
        return list(params)
    try:
        return list(revert_weight_conversion(model, dict(params)))  # type: ignore[arg-type]  # any model: see the except
    except (AttributeError, TypeError, ValueError, KeyError):
        return list(params)
