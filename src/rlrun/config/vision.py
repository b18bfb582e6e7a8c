"""The vision-language section (rlrun.ppo): which part of a VLM policy trains, where a record's images are and how
they are sized (rlrun.vision)."""

from __future__ import annotations

from dataclasses import dataclass

from rlrun.config.fields import opt, positive
from rlrun.runtime.errors import ConfigError


@dataclass
class VisionConfig:
    """Vision-language policies."""

    freeze_visual_encoder: bool = opt(
        False,
        "Vision-language policies: train the language model only; the vision "
        "tower and its projector keep their weights (no gradients, no optimizer "
        "state).",
    )
    freeze_prefix: tuple[str, ...] | None = opt(
        None,
        "Keep the actor's parameters whose names start with these fixed "
        "(OpenRLHF-M's --freeze_prefix visual); checkpoint names and "
        "the model's own both match.",
    )
    image_key: str = opt(
        "images",
        "Vision-language policies: field holding each prompt's images, placed at the "
        "prompt's <image> placeholders (verl's data.image_key). Images inside chat "
        'messages ({"type": "image", "image": ...}, OpenRLHF-M) need no key.',
    )
    max_images_per_prompt: int = opt(
        0,
        "Vision-language policies: most images one prompt may hold (OpenRLHF's flag, "
        "vLLM's limit_mm_per_prompt); a record with more is refused at start naming "
        "it. 0: no limit (vLLM engines then take one image per prompt).",
    )
    min_pixels: int | None = opt(
        None,
        "Vision-language policies: smallest area (pixels) an image is resized to "
        "(OpenRLHF-M's --min_pixels). Unset: the model's preprocessor_config.json.",
    )
    max_pixels: int | None = opt(
        None,
        "Vision-language policies: largest area (pixels) an image is resized to "
        "(OpenRLHF-M's --max_pixels; fewer pixels, fewer image tokens). Unset: the "
        "model's preprocessor_config.json.",
    )

    def check(self) -> None:
        if self.max_images_per_prompt < 0:
            raise ConfigError(f"--max_images_per_prompt must be >= 0 (0: no limit), got {self.max_images_per_prompt}")
        for name in ("min_pixels", "max_pixels"):
            positive(name, getattr(self, name), allow_none=True)
