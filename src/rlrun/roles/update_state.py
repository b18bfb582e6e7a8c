"""What a checkpoint records about a trained model and its update loop, and the checks that a checkpoint
fits the run resuming from it (shared by PPO's and the supervised trainers' checkpoints)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from torch import nn

from rlrun.roles.update import Updater


def fingerprint(model: nn.Module) -> dict[str, Any]:
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    digest = hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:16]
    return {"digest": digest, "num_params": len(shapes), "shapes": shapes}


def updater_state(u: Updater) -> dict[str, Any]:
    sched = {k: v for k, v in u.scheduler.state_dict().items() if k != "lr_lambdas"}
    return {"scheduler": sched, "skipped_steps": u.skipped_steps}


def load_updater_state(u: Updater, state: dict[str, Any]) -> None:
    """Continue the schedule where the checkpoint left it, at THIS run's learning rate: the stored schedule
    carries the saving run's base rate, which would otherwise silently override a changed --learning_rate.
    With an unchanged rate nothing is touched (an exact resume stays exact)."""
    configured = list(u.scheduler.base_lrs)  # set from the config when the scheduler was built
    sched = dict(state["scheduler"])
    sched["lr_lambdas"] = [None] * len(u.optimizer.param_groups)
    u.scheduler.load_state_dict(sched)
    if list(u.scheduler.base_lrs) != configured:
        step = u.scheduler.last_epoch
        factors = [fn(step) for fn in u.scheduler.lr_lambdas]  # type: ignore[attr-defined]
        lrs = [base * factor for base, factor in zip(configured, factors)]
        u.scheduler.base_lrs = configured
        for group, base, lr in zip(u.optimizer.param_groups, configured, lrs):
            group["initial_lr"], group["lr"] = base, lr
        u.scheduler._last_lr = lrs  # what get_last_lr() reports (the logged lr)
    u.skipped_steps = int(state["skipped_steps"])


def strategy_problem(meta: dict[str, Any], strategy: str, root: str) -> str | None:
    written_with = meta.get("strategy", "fsdp")  # checkpoints from before --strategy existed are FSDP2's
    if written_with == strategy:
        return None
    return (f"checkpoint at step {meta.get('step')} in {root} was written with --strategy {written_with}, "
            f"this run uses --strategy {strategy}; resume with --strategy {written_with} or point --ckpt_path elsewhere")


def architecture_problem(meta: dict[str, Any], key: str, model: nn.Module, root: str, what: str = "policy") -> str | None:
    """Why the fingerprint of the `what` model stored under meta[key] does not fit `model` (None: it fits)."""
    mine, theirs = fingerprint(model), meta.get(key, {})
    if mine["digest"] == theirs.get("digest"):
        return None
    a, b = mine["shapes"], theirs.get("shapes", {})
    only_ckpt = sorted(set(b) - set(a))[:3]
    only_model = sorted(set(a) - set(b))[:3]
    shape = [f"{n}: checkpoint {b[n]} vs model {a[n]}" for n in sorted(set(a) & set(b)) if a[n] != b[n]][:3]
    return (f"checkpoint at step {meta.get('step')} in {root} was written for a different {what} architecture "
            f"({theirs.get('num_params')} parameter tensors vs {mine['num_params']}; only in checkpoint: {only_ckpt}; "
            f"only in model: {only_model}; shape differs: {shape}). Point --ckpt_path elsewhere or load the same model.")
