"""Which transformers auto class builds a policy from its config: causal LMs, and vision-language models (Qwen2-VL,
Qwen2.5-VL and the image-text-to-text classes with their contract), which transformers does not register as
causal LMs."""

from __future__ import annotations

from typing import Any

from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    PretrainedConfig,
)

# The transformers auto classes rlrun builds its models with (`from_config`, `from_pretrained`).
AutoClass = type[AutoModelForCausalLM | AutoModelForImageTextToText | AutoModelForSequenceClassification]


def is_vision_language(config: PretrainedConfig) -> bool:
    """A config with a vision tower (its `vision_config`) feeding the language model."""
    return getattr(config, "vision_config", None) is not None


def tied_embeddings(config: Any) -> bool:
    """Whether the LM head is the token embedding: the text config's flag, else (VLM text configs that lack one,
    e.g. Qwen2-VL's in transformers 5) the top-level config's."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = getattr(text, "tie_word_embeddings", None)
    return bool(getattr(config, "tie_word_embeddings", False) if tied is None else tied)


def policy_auto_class(config: PretrainedConfig) -> type[AutoModelForCausalLM | AutoModelForImageTextToText]:
    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
