"""Saving the trained policy in Hugging Face format (safetensors + config + tokenizer).

An export is what a user takes away from a run, so it refuses weights that are not finite (naming the tensor)
unless asked (--export_nonfinite), and a refused write (disk full, read-only, permission) is one line naming
the path and the space needed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

import torch
from torch import nn
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase

from rlrun.data.tensor_files import unshared
from rlrun.models.loading import ScalarHeadModel
from rlrun.roles.actor import Actor
from rlrun.roles.critic import Critic
from rlrun.runtime.errors import ConfigError
from rlrun.runtime.storage import storage_cause, storage_error
from rlrun.strategies.base import Strategy


class NonFiniteWeights(ConfigError):
    """An export would write NaN/inf weights."""


def check_finite(state: Mapping[str, torch.Tensor], path: str, flag: str) -> None:
    """NonFiniteWeights naming the first tensor with NaN/inf values (and how many tensors have them)."""
    bad = [(name, int((~torch.isfinite(t)).sum())) for name, t in state.items()
           if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        name, count = bad[0]
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise NonFiniteWeights(f"not exporting to {path}: weight {name} has {count} NaN/inf values{more}; the run "
                               "diverged or loaded a damaged checkpoint. Pass --export_nonfinite to write it anyway "
                               f"({flag})")


@contextlib.contextmanager
def _storage_errors(path: str, state: Mapping[str, torch.Tensor], flag: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        cause = storage_cause(exc)
        if cause is None:
            raise
        needs = sum(t.numel() * t.element_size() for t in state.values())
        raise storage_error("the model", path, cause, needs, f"free space there or choose another {flag}") from None


def _make_dir(path: str, flag: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {path} ({flag}): {exc.strerror}") from None


def save_policy(actor: Actor | None, tokenizer: PreTrainedTokenizerBase, path: str, *, is_writer: bool,
                strategy: Strategy | None, allow_nonfinite: bool = False) -> None:
    """Collective over the actor ranks; the writer (global rank 0, always an actor rank) writes.
    `strategy`: the actor's (RankRoles.strategies), which knows how to assemble its full weights."""
    if actor is None:
        return
    assert strategy is not None, "an actor rank always has the actor's strategy"
    save_causal_lm(actor.model, tokenizer, path, is_writer=is_writer, strategy=strategy, allow_nonfinite=allow_nonfinite)


def save_causal_lm(model: nn.Module, tokenizer: PreTrainedTokenizerBase, path: str, *, is_writer: bool,
                   strategy: Strategy, flag: str = "--save_path", allow_nonfinite: bool = False) -> None:
    """A (wrapped) causal LM in HF format with its tokenizer. Collective over the model's role; the writer
    must be global rank 0 (transformers' save_pretrained writes there only)."""
    state = strategy.full_state_dict(model)
    if not is_writer:
        return
    if not allow_nonfinite:
        check_finite(state, path, flag)
    with _storage_errors(path, state, flag):
        _make_dir(path, flag)
        model.save_pretrained(path, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(path)


def save_critic(critic: Critic, path: str, *, is_writer: bool, strategy: Strategy, allow_nonfinite: bool = False) -> None:
    """The critic as a sequence-classification model (num_labels 1). Collective over the critic ranks."""
    save_scalar_model(critic.model, path, is_writer=is_writer, strategy=strategy, flag="--save_value_network",
                      allow_nonfinite=allow_nonfinite)


def save_scalar_model(model: ScalarHeadModel, path: str, *, is_writer: bool, strategy: Strategy, flag: str,
                      tokenizer: PreTrainedTokenizerBase | None = None, allow_nonfinite: bool = False) -> None:
    """A sequence-classification model (num_labels 1; its config carries any mean/std set on it), with the
    tokenizer when given. Collective over the model's role; `is_writer` may be any rank of it."""
    state = strategy.full_state_dict(model)
    if not is_writer:
        return
    if not allow_nonfinite:
        check_finite(state, path, flag)
    with _storage_errors(path, state, flag):
        _make_dir(path, flag)
        # The writer writes the files itself: transformers' save_pretrained writes on global rank 0 only
        # (should_save_on_this_rank), and a critic on ranks of its own does not hold rank 0.
        config = model.hf.config
        config.architectures = [type(model.hf).__name__.removeprefix("FSDP")]  # a policy's body keeps its causal-LM name
        config.to_json_file(os.path.join(path, "config.json"))
        save_file(unshared((k.removeprefix("hf."), v) for k, v in state.items()),
                  os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(path)

