"""Which transformers auto class builds a policy from its config: causal LMs, and vision-language models (Qwen2-VL,
Qwen2.5-VL and the image-text-to-text classes with their contract), which transformers does not register as
causal LMs."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig


def is_vision_language(config: PretrainedConfig) -> bool:
    """A config with a vision tower (its `vision_config`) feeding the language model."""
    return getattr(config, "vision_config", None) is not None


def policy_auto_class(config: PretrainedConfig) -> type:
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
