"""The model's image processor (transformers, behind this one adapter): prompt images -> pixel patches, and the
prompt's image tokens expanded to one per merged patch, as the model's HF processor does.

Only the image half of the HF processor is used: Qwen2-VL's composite processor also insists on its video processor,
which needs torchvision (no build exists for every torch, e.g. rlrun's CPU torch); images need only this part. The
chat template (the tokenizer's) renders each image entry as the model's image token, once; prepare() repeats it
grid_t x grid_h x grid_w / merge_size^2 times, the processor's rule.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoImageProcessor, PretrainedConfig

from rlrun.runtime.errors import ConfigError, DataError
from rlrun.data.vision_batch import PromptVision
from rlrun.data.images import load_image


def load_image_processor(folder: str, min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    """The model's image processor (preprocessor_config.json), its resize bounds overridden where given."""
    overrides = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    try:
        return AutoImageProcessor.from_pretrained(folder, **overrides)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{folder}: the vision-language model's image processor cannot be read ({exc}); its "
                          "folder needs the preprocessor_config.json saved with the model") from exc


class ImageInputs:
    """Preprocessing of one model's prompt images. min_pixels/max_pixels (OpenRLHF-M's flags) bound each image's
    resized area; None keeps the model's preprocessor_config.json."""

    def __init__(self, folder: str, config: PretrainedConfig, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> None:
        self.processor = load_image_processor(folder, min_pixels, max_pixels)
        self.image_token_id = int(config.image_token_id)
        self.merge = int(getattr(self.processor, "merge_size", None) or config.vision_config.spatial_merge_size)
        self.dim = int(config.vision_config.in_channels * config.vision_config.temporal_patch_size
                       * config.vision_config.patch_size ** 2)

    def prepare(self, ids: list[int], images: tuple[Any, ...], where: str, base_dir: str | None = None
                ) -> tuple[list[int], PromptVision]:
        """A prompt's token ids (one image token per image) and its images (any rlrun.data.images form) ->
        (ids with each image token repeated once per merged patch, the images' pixel patches and grids)."""
        places = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(places) != len(images):
            raise DataError(f"{where}: the prompt renders {len(places)} image tokens for {len(images)} images; the chat "
                            "template must render each image entry once (as Qwen2-VL's does), and a prompt cut by "
                            "--prompt_max_len loses its images (raise --prompt_max_len)")
        if not images:
            return list(ids), PromptVision.empty(self.dim)
        pil = [load_image(ref, where, base_dir) for ref in images]
        try:
            out = self.processor(images=pil, return_tensors="pt")
        except (ValueError, TypeError, OSError) as exc:
            raise DataError(f"{where}: the image processor failed on its images ({exc})") from exc
        grid = out["image_grid_thw"].long()
        counts = (grid.prod(dim=1) // self.merge ** 2).tolist()
        expanded: list[int] = []
        start = 0
        for place, count in zip(places, counts):
            expanded += ids[start:place] + [self.image_token_id] * count
            start = place + 1
        expanded += ids[start:]
        return expanded, PromptVision(out["pixel_values"].float(), grid, tuple(pil))
