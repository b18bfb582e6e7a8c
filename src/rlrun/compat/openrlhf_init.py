"""`rlrun.ppo --load_openrlhf_checkpoint ROOT`: start the actor (and critic) from an OpenRLHF DeepSpeed checkpoint.

`plan_init` runs on every rank before the first collective (cheap checks of the layout, rlrun.compat.
openrlhf_reader reads it); `init_from_openrlhf` runs after the roles are built: every actor/critic rank
reads the files itself and writes the full weights into its FSDP2 shard / DeepSpeed ZeRO-0/1/2 partition; no
collective, no temp files.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from typing import Any

import torch

from rlrun.checkpoint.store import CheckpointError
from rlrun.compat.openrlhf_checkpoint import apply_weights
from rlrun.compat.openrlhf_reader import (OPTIMIZER_NOTE, TagFiles, list_tags, actor_names, client_state_of,
                                          critic_names, inspect_tag, part_dir, read_deepspeed_weights, resolve_tag)


@dataclass(frozen=True)
class InitPlan:
    """What --load_openrlhf_checkpoint will read, checked on every rank before the first collective."""

    root: str
    tag: str
    actor: TagFiles
    critic: TagFiles | None  # None: the run has no critic, or the checkpoint has no _critic

    @property
    def global_step(self) -> int:
        return int(client_state_of(self.actor).get("global_step", 0))


def plan_init(root: str, *, run_has_critic: bool) -> InitPlan:
    """Resolve the tag and check every file is there (reads only rank 0's model-states file, memory-mapped)."""
    try:
        tag = resolve_tag(os.path.abspath(root), None, name_tag=f"write the tag to use into {root}/_actor/latest")
    except CheckpointError as exc:
        raise CheckpointError(f"--load_openrlhf_checkpoint: {exc}") from None
    root = os.path.abspath(root)
    actor = inspect_tag(os.path.join(part_dir(root, "actor"), tag))
    critic = None
    if run_has_critic and os.path.isdir(part_dir(root, "critic")):
        tag_dir = os.path.join(part_dir(root, "critic"), tag)
        if not os.path.isdir(tag_dir):
            raise CheckpointError(f"--load_openrlhf_checkpoint {root}: _actor has tag {tag!r} but _critic does not "
                                  f"(tags there: {list_tags(part_dir(root, 'critic')) or 'none'}); point `latest` in both "
                                  "at a tag they share")
        critic = inspect_tag(tag_dir)
    return InitPlan(root, tag, actor, critic)


def _lazy_weights(part: str, tag: str, files: TagFiles) -> dict[str, Any]:
    """name -> tensor, or a zero_to_fp32 lazy tensor (`.contiguous()` materialises it): the optimizer files are
    memory-mapped, so ranks on one node share the page cache instead of each holding a full fp32 copy."""
    if files.zero_stage == 0:
        return read_deepspeed_weights(part, tag, files)[0]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: PLC0415

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return dict(get_fp32_state_dict_from_zero_checkpoint(part, tag=tag, lazy_mode=True))
    except (ValueError, FileNotFoundError, KeyError, NotImplementedError, RuntimeError, OSError) as exc:
        raise CheckpointError(f"{files.tag_dir}: DeepSpeed's zero_to_fp32 could not rebuild the weights: "
                              f"{type(exc).__name__}: {exc}") from exc


def hf_module_of(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a role's model: a DeepSpeed engine keeps it as `.module`, rlrun's critic
    (ScalarHeadModel) as `.hf`; FSDP2 shards in place and keeps the names."""
    inner = model.module if hasattr(model, "module") and hasattr(model, "optimizer") else model
    return getattr(inner, "hf", inner)


def init_from_openrlhf(plan: InitPlan, actor: torch.nn.Module | None, critic: torch.nn.Module | None) -> str:
    """Overwrite the wrapped actor's (and critic's) weights with the checkpoint's; every rank of the role reads
    the files itself (no collective). Returns a line for the log."""
    if actor is not None:
        weights = _lazy_weights(part_dir(plan.root, "actor"), plan.tag, plan.actor)
        apply_weights(hf_module_of(actor), actor_names(weights, plan.actor.tag_dir), f"{plan.actor.tag_dir} (actor)")
    if critic is not None and plan.critic is not None:
        weights = _lazy_weights(part_dir(plan.root, "critic"), plan.tag, plan.critic)
        apply_weights(hf_module_of(critic), critic_names(weights, plan.critic.tag_dir),
                      f"{plan.critic.tag_dir} (critic)")
    parts = "actor and critic" if plan.critic is not None else "actor"
    if plan.actor.zero_stage == 0 and any(t.is_floating_point() and t.dtype != torch.float32
                                          for t in plan.actor.meta["module"].values()):
        parts += " (ZeRO-0 in 16 bits: the checkpoint has no fp32 master weights; its 16-bit copy is used)"
    return (f"initialised the {parts} from OpenRLHF checkpoint {plan.root} tag {plan.tag} (ZeRO-{plan.actor.zero_stage}, "
            f"{plan.actor.dp_world_size} ranks; OpenRLHF global_step {plan.global_step}); steps count from 0 here. "
            + OPTIMIZER_NOTE)
