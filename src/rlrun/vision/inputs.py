"""The model's image processor (transformers, behind this one adapter): prompt images -> pixel patches, and the
prompt's image tokens expanded to one per merged patch, as the model's HF processor does.

Only the image half of the HF processor is used: Qwen2-VL's composite processor also insists on its video processor,
which needs torchvision (no build exists for every torch, e.g. rlrun's CPU torch); images need only this part. The
chat template (the tokenizer's) renders each image entry as the model's image token, once; prepare() repeats it
grid_t x grid_h x grid_w / merge_size^2 times, the processor's rule.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypedDict

import torch
from torch import nn
from transformers import PretrainedConfig

from rlrun.config.model import PretrainedConfig as ModelSettings
from rlrun.config.vision import VisionConfig
from rlrun.data.images import load_image
from rlrun.data.packing import PackedBatch
from rlrun.data.rollout import RolloutBatch
from rlrun.data.vision_batch import PromptVision, RowVision
from rlrun.models.adapter_pretrain import model_folder
from rlrun.models.architecture import is_vision_language
from rlrun.models.loading import load_model_config
from rlrun.runtime.errors import ConfigError, DataError


class _PixelBounds(TypedDict, total=False):
    """The resize bounds given (an absent key keeps the preprocessor_config.json's own)."""

    min_pixels: int
    max_pixels: int


def load_image_processor(folder: str, min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    """The model's image processor (preprocessor_config.json), its resize bounds overridden where given."""
    from transformers import AutoImageProcessor  # noqa: PLC0415 - seconds of image-processing imports a text run skips

    overrides = _PixelBounds()
    if min_pixels is not None:
        overrides["min_pixels"] = min_pixels
    if max_pixels is not None:
        overrides["max_pixels"] = max_pixels
    try:
        return AutoImageProcessor.from_pretrained(folder, **overrides)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{folder}: the vision-language model's image processor cannot be read ({exc}); its "
            "folder needs the preprocessor_config.json saved with the model"
        ) from exc


def image_inputs(model: ModelSettings, v: VisionConfig) -> ImageInputs | None:
    """A vision-language policy's image preprocessing (its --min_pixels/--max_pixels); None for a text policy."""
    config = load_model_config(model)
    if not is_vision_language(config):
        return None
    assert model.pretrain is not None  # the embedded models are text-only
    return ImageInputs(model_folder(model.pretrain, "pretrain"), config, v.min_pixels, v.max_pixels)


class ImageInputs:
    """Preprocessing of one model's prompt images. min_pixels/max_pixels (OpenRLHF-M's flags) bound each image's
    resized area; None keeps the model's preprocessor_config.json."""

    def __init__(
        self, folder: str, config: PretrainedConfig, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> None:
        self.processor = load_image_processor(folder, min_pixels, max_pixels)
        self.image_token_id = int(config.image_token_id)
        self.merge = int(getattr(self.processor, "merge_size", None) or config.vision_config.spatial_merge_size)
        self.dim = int(
            config.vision_config.in_channels
            * config.vision_config.temporal_patch_size
            * config.vision_config.patch_size**2
        )

    def prepare(
        self, ids: list[int], images: tuple[Any, ...], where: str, base_dir: str | None = None
    ) -> tuple[list[int], PromptVision]:
        """A prompt's token ids (one image token per image) and its images (any rlrun.data.images form) ->
        (ids with each image token repeated once per merged patch, the images' pixel patches and grids)."""
        places = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(places) != len(images):
            raise DataError(
                f"{where}: the prompt renders {len(places)} image tokens for {len(images)} images; the "
                f"chat "
                "template must render each image entry once (as Qwen2-VL's does), and a prompt cut by "
                "--prompt_max_len loses its images (raise --prompt_max_len)"
            )
        if not images:
            return list(ids), PromptVision.empty(self.dim)
        pil = [load_image(ref, where, base_dir) for ref in images]
        try:
            out = self.processor(images=pil, return_tensors="pt")
        except (ValueError, TypeError, OSError) as exc:
            raise DataError(f"{where}: the image processor failed on its images ({exc})") from exc
        grid = out["image_grid_thw"].long()
        counts = (grid.prod(dim=1) // self.merge**2).tolist()
        expanded: list[int] = []
        start = 0
        for place, count in zip(places, counts):
            expanded += ids[start:place] + [self.image_token_id] * count
            start = place + 1
        expanded += ids[start:]
        return expanded, PromptVision(out["pixel_values"].float(), grid, tuple(pil))


# ---- positions ---------------------------------------------------------------------------------------------------
# A vision-language model's forward inputs for rollout rows: pixel patches, image grids and the multimodal rotary
# positions (Qwen2-VL's mrope: temporal/height/width ids for image tokens, one shared id for text), computed by the
# model's own `get_rope_index` over each row's real tokens, for padded and packed rows alike (the transformers
# contract lives here).


def quiet_output_view_warning() -> None:
    """A VLM's forward output also carries the image features and rope deltas it computed, which FSDP2 flags on
    every call as views that an in-place op could break; rlrun reads only the logits (never in place)."""
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module \(FSDP\w+ForConditionalGeneration\) returned a view"
    )


def _rope_index(model: nn.Module) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The get_rope_index of the VLM inside `model` (itself, or what FSDP2, DeepSpeed or PEFT wrap)."""
    for module in model.modules():
        fn = getattr(module, "get_rope_index", None)
        if callable(fn):
            return fn
    raise ValueError(
        f"{type(model).__name__} has no get_rope_index: rlrun's vision-language path runs models with "
        "Qwen2-VL's multimodal rotary positions (Qwen2-VL, Qwen2.5-VL)"
    )


def _config(model: nn.Module) -> Any:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "image_token_id", None) is not None:
            return config
    raise ValueError(f"{type(model).__name__} has no config with an image_token_id")


def _image_marks(model: nn.Module, fn: Callable[..., Any], input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"mm_token_type_ids": 1 on image tokens} for a transformers whose `fn` takes it (>= 5.2x: the marks, not the
    token ids, say where images are), else {}."""
    if "mm_token_type_ids" not in inspect.signature(fn).parameters:
        return {}
    return {"mm_token_type_ids": (input_ids == int(_config(model).image_token_id)).int()}


def mrope_positions(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, grid_thw: torch.Tensor | None
) -> torch.Tensor:
    """[b, L] tokens (images' tokens expanded), [b, L] mask, [images, 3] grids of the rows' images in row order ->
    [3, b, L] positions; masked positions get 1, as transformers gives them."""
    fn = _rope_index(model)
    positions, _ = fn(
        input_ids, image_grid_thw=grid_thw, attention_mask=attention_mask, **_image_marks(model, fn, input_ids)
    )
    return positions


VISION_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def vision_token_ids(model: nn.Module) -> list[int]:
    """The ids of the tokens that mark images and videos in a prompt (Qwen2-VL's image pad, video pad, vision
    start/end)."""
    config = _config(model)
    return [int(v) for v in (getattr(config, key, None) for key in VISION_TOKEN_KEYS) if v is not None]


def generate_inputs(model: nn.Module, input_ids: torch.Tensor, vision: RowVision) -> dict[str, Any]:
    """Extra kwargs of HF `generate` for left-padded prompts [b, P]: pixels, grids, (transformers >= 5.2x) the
    image-token marks from which generate computes the multimodal positions itself, and the vision tokens
    suppressed: a response holding an image token would be read as an image without pixels by every later forward
    (a trained VLM gives them ~0 probability; a small or fresh one does not)."""
    images: dict[str, Any] = vision.model_inputs(input_ids.device, torch.float32)
    if images:
        images.update(_image_marks(model, model.forward, input_ids))
    images["suppress_tokens"] = vision_token_ids(model)
    return images


def padded_inputs(
    model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, vision: RowVision
) -> dict[str, torch.Tensor]:
    """Forward kwargs for padded rows [b, L]: pixel_values, image_grid_thw and [3, b, L] position_ids."""
    images = vision.model_inputs(sequences.device, torch.float32)
    positions = mrope_positions(model, sequences, attention_mask, images.get("image_grid_thw"))
    return {**images, "position_ids": positions}


def packed_inputs(model: nn.Module, part: RolloutBatch, packed: PackedBatch) -> dict[str, torch.Tensor]:
    """Forward kwargs for `part` packed as `packed` (rlrun.data.packing): pixel_values and image_grid_thw in packing
    order, and [4, n, W] position_ids: first the text positions restarting per sequence (from which transformers
    keeps the sequences apart), then each sequence's own mrope positions (as on its padded row)."""
    assert part.vision is not None
    device = packed.input_ids.device
    order = [i for row in packed.rows for i in row]
    images = part.vision[torch.tensor(order, dtype=torch.long)].model_inputs(device, torch.float32)
    grids = part.vision.grids()
    own = mrope_positions(
        model, part.sequences, part.attention_mask, None if grids is None else grids.to(device)
    )  # [3, b, L]
    positions = packed.position_ids.unsqueeze(0).repeat(4, 1, 1)
    real = part.attention_mask.bool()
    for r, row in enumerate(packed.rows):
        col = 0
        for i in row:
            seq = own[:, i, real[i]]
            positions[1:, r, col : col + seq.shape[1]] = seq
            col += seq.shape[1]
    return {**images, "position_ids": positions}
