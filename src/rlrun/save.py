"""Saving the trained policy in Hugging Face format (safetensors + config + tokenizer)."""

from __future__ import annotations

import os

from transformers import PreTrainedTokenizerBase

from rlrun.errors import ConfigError
from rlrun.launch.fsdp import full_state_dict
from rlrun.roles.actor import Actor


def save_policy(actor: Actor | None, tokenizer: PreTrainedTokenizerBase, path: str, *, is_writer: bool) -> None:
    """Collective over the actor ranks; the writer (global rank 0, always an actor rank) writes."""
    if actor is None:
        return
    state = full_state_dict(actor.model)
    if not is_writer:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create --save_path {path}: {exc.strerror}") from None
    actor.model.save_pretrained(path, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(path)
