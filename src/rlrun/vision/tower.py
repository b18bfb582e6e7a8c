"""The vision tower of a vision-language model: what --freeze_visual_encoder keeps fixed."""

from __future__ import annotations

from torch import nn

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
        raise ConfigError(f"--freeze_visual_encoder: {type(model).__name__} has no vision tower (none of the "
                          f"submodules {', '.join(VISION_MODULES)}); it is for vision-language models")
    for p in params.values():
        p.requires_grad_(False)
    return sum(p.numel() for p in params.values())
