"""Which run a checkpoint directory belongs to, decided before anything runs.

A run is identified by its launcher where the launcher keeps one across restarts (torchrun's rendezvous run
id, which every restarted worker group of one `torchrun` shares; a Slurm job id, which a requeued job keeps),
else by a fresh random id. Every checkpoint records its run id and the digest of its config
(rlrun.checkpoint.store). A new run pointed at a directory that holds another run's checkpoints, without
--load_checkpoint, stops at start-up instead of mixing its checkpoints with them: before this check a new run's
first save pruned the older run's newer checkpoints away, silently.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rlrun.checkpoint.store import CheckpointError, step_dirs, writer_of


def is_restart(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process belongs to a worker group torchrun restarted after a failure."""
    env = os.environ if environ is None else environ
    return env.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")


def run_identity(environ: Mapping[str, str] | None = None) -> str:
    """This run's id: the same in every process of the run and across elastic restarts where the launcher allows."""
    env = os.environ if environ is None else environ
    elastic = env.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic.lower() != "none":  # torchrun's default rdzv id for non-standalone runs is "none"
        return f"torchrun-{elastic}"
    if env.get("SLURM_JOB_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}"
    return f"run-{uuid.uuid4().hex[:16]}"


def preemption_dir(ckpt_path: str, run_id: str) -> str:
    """Where a run that saves no checkpoints (--save_steps -1) saves the one a preemption notice asks for: a
    directory of its own under --ckpt_path, named by the run's id, which a requeued Slurm job keeps, so the requeued
    job finds it there and nothing else in it is another run's."""
    return os.path.join(ckpt_path, f"preempted-{run_id}")


def holds_checkpoint(root: str) -> bool:
    """Whether `root` holds a sealed checkpoint."""
    return bool(_sealed_runs(root))


def can_create(path: str) -> bool:
    """Whether this process could create `path` (its nearest existing ancestor is a writable directory), without
    creating anything."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return False
        probe = parent
    return os.path.isdir(probe) and os.access(probe, os.W_OK | os.X_OK)


def config_digest(config: Mapping[str, Any]) -> str:
    """A short digest of a (redacted) config dict: equal configs, equal digests."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def run_record(run_id: str, config: Mapping[str, Any]) -> dict[str, str]:
    """What a checkpoint's meta records about the run that wrote it."""
    return {"id": run_id, "config_digest": config_digest(config)}


def _sealed_runs(root: str) -> list[tuple[int, str, str | None]]:
    """(step, directory name, run id) of every sealed checkpoint under root, newest first."""
    return [
        (step, os.path.basename(path), run)
        for step, path in step_dirs(root)
        for sealed, run in [writer_of(path)]
        if sealed
    ]


def check_ownership(root: str, run_id: str, *, loads: bool, overwrites: bool, restarted: bool) -> str | None:
    """Before a run that saves checkpoints into `root` starts. Raises CheckpointError when `root` holds another
    run's checkpoints and this run neither continues them (--load_checkpoint) nor was told to replace them
    (--overwrite_checkpoints). Returns a line to log when it replaces them (None otherwise).

    A run that is not an elastic restart (`restarted` False) has written nothing yet, so every checkpoint
    there is another run's, whatever id it records (launchers reuse ids: RunPod's default rendezvous id);
    a restarted worker group owns the checkpoints its earlier attempts wrote under the same id."""
    if loads:
        return None
    others = [(step, name, run) for step, name, run in _sealed_runs(root) if not restarted or run != run_id]
    if not others:
        return None
    newest_step, _, newest_run = others[0]
    listing = ", ".join(name for _, name, _ in others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    if overwrites:
        return (
            f"--overwrite_checkpoints: {len(others)} checkpoint(s) of another run in {root} ({listing}) will be "
            "deleted when this run saves its first checkpoint"
        )
    raise CheckpointError(
        f"--ckpt_path {root} holds checkpoints of another run ({listing}; newest step {newest_step}, written by "
        f"{newest_run or 'an earlier rlrun'}); a new run there would mix its checkpoints with them. Pass "
        "--load_checkpoint to continue that run, choose a fresh --ckpt_path, or pass --overwrite_checkpoints to "
        "replace them (they are deleted at this run's first save)"
    )


# ---- config changes ----------------------------------------------------------------------------------------------
# What changed between the config a checkpoint was written with and the config resuming from it.
#
# A resume continues a run, so a change is either impossible to honour (the weights, the algorithm's state or
# the position in the data would no longer mean what they meant: an error naming the reason) or applied from
# the next step and said once (learning rates, step counts, logging, the number of ranks). Each trainer names
# its own impossible changes: a PPO step consumes rollout_batch_size prompts, an SFT step train_batch_size
# samples. Both configs are compared as stored: redacted (rlrun.config.fields.redacted), so secrets never
# appear in a message.

# How the run is started, not what it trains: never worth a line.
NOT_A_CHANGE = frozenset(
    {"load_checkpoint", "overwrite_checkpoints", "ckpt_path", "dry_run", "plan_json", "gpu_memory_gb"}
)


@dataclass(frozen=True)
class Change:
    name: str
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"--{self.name} {_show(self.before)} -> {_show(self.after)}"


@dataclass
class ResumeChanges:
    refused: list[tuple[Change, str]] = field(default_factory=list)  # (change, why it cannot be applied)
    applied: list[Change] = field(default_factory=list)


def _show(value: Any) -> str:
    text = "unset" if value is None else repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _flat(config: Mapping[str, Any]) -> dict[str, Any]:
    """{field: value} of a nested {section: {field: value}} config dict (field names are unique: they are flags)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            out.update(value)
        else:
            out[key] = value
    return out


def resume_changes(stored: Mapping[str, Any], current: Mapping[str, Any], fixed: Mapping[str, str]) -> ResumeChanges:
    """Every setting whose value differs, split into refused (named in `fixed`, with its reason) and applied."""
    # As stored: through JSON, so a tuple and the list it was saved as are the same value.
    before, after = (
        _flat(json.loads(json.dumps(stored, default=str))),
        _flat(json.loads(json.dumps(current, default=str))),
    )
    changes = ResumeChanges()
    for name in sorted(set(before) | set(after)):
        if name in NOT_A_CHANGE or name not in before or name not in after or before[name] == after[name]:
            continue  # a setting the checkpoint's rlrun did not have keeps its default meaning
        change = Change(name, before[name], after[name])
        if name in fixed:
            changes.refused.append((change, fixed[name]))
        else:
            changes.applied.append(change)
    return changes


def check_resume(
    meta: Mapping[str, Any], current: Mapping[str, Any], fixed: Mapping[str, str], path: str, say: Callable[[str], None]
) -> str | None:
    """Why the checkpoint `meta` records cannot continue with this run's (redacted) config `current` (None: it
    can; then what the resume changes, if anything, goes to `say` in one line)."""
    stored = meta.get("config")
    if not isinstance(stored, Mapping):
        return None  # written before configs were stored: nothing to compare
    changes = resume_changes(stored, current, fixed)
    if changes.refused:
        change, why = changes.refused[0]
        more = (
            f" (and {len(changes.refused) - 1} more: " + ", ".join(str(c) for c, _ in changes.refused[1:]) + ")"
            if len(changes.refused) > 1
            else ""
        )
        return (
            f"cannot resume the step-{meta.get('step')} checkpoint in {path} with {change}{more}: {why}. Resume "
            "with the checkpoint's value, or start a new run with a fresh --ckpt_path"
        )
    if changes.applied:
        say("resuming with changed settings (applied from the next step): " + ", ".join(map(str, changes.applied)))
    return None
