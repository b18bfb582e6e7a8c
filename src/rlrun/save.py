"""Saving the trained policy in Hugging Face format (safetensors + config + tokenizer)."""

from __future__ import annotations

import os

from transformers import PreTrainedTokenizerBase

from rlrun.errors import ConfigError
from rlrun.launch.fsdp import full_state_dict
from rlrun.roles.actor import Actor
from rlrun.roles.critic import Critic


def _make_dir(path: str, flag: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {path} ({flag}): {exc.strerror}") from None


def save_policy(actor: Actor | None, tokenizer: PreTrainedTokenizerBase, path: str, *, is_writer: bool) -> None:
    """Collective over the actor ranks; the writer (global rank 0, always an actor rank) writes."""
    if actor is None:
        return
    state = full_state_dict(actor.model)
    if not is_writer:
        return
    _make_dir(path, "--save_path")
    actor.model.save_pretrained(path, state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(path)


def save_critic(critic: Critic, path: str, *, is_writer: bool) -> None:
    """The critic as a sequence-classification model (num_labels 1). Collective over the critic ranks."""
    state = full_state_dict(critic.model)
    if not is_writer:
        return
    _make_dir(path, "--save_value_network")
    hf_state = {k.removeprefix("hf."): v for k, v in state.items()}
    critic.model.hf.save_pretrained(path, state_dict=hf_state, safe_serialization=True)
