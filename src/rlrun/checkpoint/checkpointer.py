"""One checkpointer for every trainer: what a checkpoint holds is a list of parts the trainer names, plus the
trainer's own state (a torch `Stateful`: `state_dict` / `load_state_dict`) in `trainer_state.json`.

A part is one piece of a step directory: a role's sharded model and optimizer (its strategy writes them with DCP,
collective over the role: rlrun.strategies.base.ModelState), a JSON state one rank writes (`JsonState`), an HF
export, the batch in flight. Saving runs every part this rank holds (rlrun.checkpoint.collective.write_parts) and
seals the directory; restoring takes the newest checkpoint that fits this run (same strategy, same model
architecture, no setting changed that the checkpoint's meaning depends on) and loads every part, then the state.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from rlrun.checkpoint import store
from rlrun.checkpoint.collective import restore_newest, save_checkpoint, write_parts
from rlrun.checkpoint.resume import check_resume, run_record
from rlrun.config.checkpoint import SavingConfig
from rlrun.runtime.log import get_logger

STATE_FILE = "trainer_state.json"


class Part(Protocol):
    """One rank's share of one piece of a checkpoint (a rank holding nothing of it is given no such part)."""

    def save(self, path: str) -> None:
        """Write this rank's share into the checkpoint directory `path` (collective where the piece is)."""
        ...

    def load(self, path: str) -> None:
        """Read it back from `path` (collective where the piece is)."""
        ...


class Stateful(Protocol):
    """torch.distributed.checkpoint's Stateful: what a trainer's loop keeps besides its models."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class JsonState:
    """A Stateful saved as one JSON file by one rank (`writer`) and loaded by every rank given this part."""

    state: Stateful
    file: str
    writer: bool

    def save(self, path: str) -> None:
        if self.writer:
            store.write_json_atomic(os.path.join(path, self.file), self.state.state_dict())

    def load(self, path: str) -> None:
        with open(os.path.join(path, self.file), encoding="utf-8") as fh:
            self.state.load_state_dict(json.load(fh))


@dataclass(frozen=True)
class SaveOnly:
    """A piece written with the checkpoint and never read back (an HF export beside the resumable state)."""

    write: Callable[[str], None]

    def save(self, path: str) -> None:
        self.write(path)

    def load(self, path: str) -> None:
        pass


@dataclass(frozen=True)
class Identity:
    """What a checkpoint says about the run that wrote it, and what a resume must match: the trainer, its strategy,
    the trained model's architecture (`model`, stored under `model_key`; rank 0 holds it) and the settings whose
    meaning is baked into the checkpoint (`fixed`: name -> why)."""

    trainer: str  # "ppo" | "sft" | "rm" | "dpo"
    strategy: str
    model_key: str  # "actor" (PPO) | "model"
    model: nn.Module | None
    fixed: Mapping[str, str]
    what: str = "policy"  # the model, in the words of a mismatch message


@dataclass(frozen=True)
class Contents:
    """What one rank's checkpoints hold: the loop's state (`state`, a torch Stateful; rank 0 writes it), this rank's
    pieces (`parts`), what the checkpoint says of the run (`identity`), and the trained models (the bulk, named in a
    disk-full message)."""

    identity: Identity
    state: Stateful
    parts: Sequence[Part]
    trained: Sequence[nn.Module] = ()


class Checkpointer:
    """Saves and restores one rank's parts of a run's checkpoints under --ckpt_path (collective over `group`, every
    rank of the `world_size`; each wait bounded by `timeout_s`). `config`: the redacted config tree, stored with
    every checkpoint and compared on resume."""

    def __init__(
        self,
        saving: SavingConfig,
        contents: Contents,
        *,
        config: dict[str, Any],
        run_id: str,
        world_size: int,
        group: torch.distributed.ProcessGroup,
        device: torch.device,
        timeout_s: float,
    ) -> None:
        self.root, self.identity, self.state = saving.ckpt_path, contents.identity, contents.state
        self.parts = list(contents.parts)
        self.config, self.run_id, self.world_size = config, run_id, world_size
        self.save_steps, self.keep, self.overwrite = (
            saving.save_steps,
            saving.max_ckpt_num,
            saving.overwrite_checkpoints,
        )
        self.group, self.device, self.timeout_s = group, device, timeout_s
        self.trained = list(contents.trained)  # this rank's trained models: the checkpoint's bulk
        self.rank = torch.distributed.get_rank()
        self.log = get_logger(self.rank)
        self._saved_world_size = world_size  # the resumed checkpoint's, once found

    @property
    def saves(self) -> bool:
        """Whether this run writes checkpoints at all (--save_steps > 0)."""
        return self.save_steps > 0

    def step_dir(self, steps_done: int) -> str:
        """The directory of the checkpoint after `steps_done` steps."""
        return store.step_dir(self.root, steps_done)

    def should_save(self, steps_done: int, total_steps: int) -> bool:
        every = self.save_steps
        return every > 0 and (steps_done % every == 0 or steps_done == total_steps)

    def save(self, steps_done: int) -> None:
        """Collective over the world: rank 0 prepares and seals, every rank writes its parts."""
        pieces = [*self.parts, JsonState(self.state, STATE_FILE, writer=self.rank == 0)]
        save_checkpoint(
            self.root,
            steps_done,
            group=self.group,
            device=self.device,
            timeout_s=self.timeout_s,
            keep=self.keep,
            write=lambda path: write_parts(*(lambda p=p: p.save(path) for p in pieces)),
            meta=lambda: self._meta(steps_done),
            remove_foreign=self.overwrite,
            needs_bytes=sum(12 * p.numel() for m in self.trained for p in m.parameters()) or None,
        )

    def _meta(self, steps_done: int) -> dict[str, Any]:
        i = self.identity
        assert i.model is not None, "rank 0 holds the trained model"
        return {
            "step": steps_done,
            "trainer": i.trainer,
            i.model_key: fingerprint(i.model),
            "world_size": self.world_size,
            "strategy": i.strategy,
            "config": self.config,
            "run": run_record(self.run_id, self.config),
        }

    def restore(self) -> None:
        """Load the newest checkpoint that fits (collective; one that fails to load is skipped for the next
        newest). Nothing happens when `root` holds none. The parts load first, then the trainer's state (an
        update loop's schedule is set after its optimizer's state, which would otherwise overwrite its rate)."""
        start = time.perf_counter()
        restored = restore_newest(
            self.root, group=self.group, device=self.device, problem=self._problem, load=self._load
        )
        if restored is None:
            return
        found, step = restored
        self.run_id = found.run or self.run_id  # this run continues the resumed one
        if self.world_size != self._saved_world_size:
            self.log.info_once(f"resharding the checkpoint of {self._saved_world_size} ranks onto {self.world_size}")
        self.log.info_once(
            f"resumed from {found.path} at step {step} ({time.perf_counter() - start:.2f} s, "
            f"checksums verified in {found.verify_s:.2f} s)"
        )

    def _load(self, path: str) -> int:
        for part in self.parts:
            part.load(path)
        with open(os.path.join(path, STATE_FILE), encoding="utf-8") as fh:
            state = json.load(fh)
        self.state.load_state_dict(state)
        return int(state["step"])

    def _problem(self, meta: dict[str, Any]) -> str | None:
        """Rank 0: why the checkpoint `meta` describes cannot continue this run (None: it can; what the resume
        changes is said here, once)."""
        i = self.identity
        assert i.model is not None
        self._saved_world_size = int(meta.get("world_size", self.world_size))
        written_by = meta.get("trainer", "ppo")  # PPO's checkpoints did not name their trainer at first
        if written_by != i.trainer:
            return (
                f"checkpoint at step {meta.get('step')} in {self.root} was written by rlrun.{written_by}, this is "
                f"rlrun.{i.trainer}; point --ckpt_path at this trainer's checkpoints"
            )
        return (
            strategy_problem(meta, i.strategy, self.root)
            or architecture_problem(meta, i.model_key, i.model, self.root, what=i.what)
            or check_resume(meta, self.config, i.fixed, self.root, self.log.info_once)
        )


def fingerprint(model: nn.Module) -> dict[str, Any]:
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    digest = hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:16]
    return {"digest": digest, "num_params": len(shapes), "shapes": shapes}


def strategy_problem(meta: dict[str, Any], strategy: str, root: str) -> str | None:
    written_with = meta.get("strategy", "fsdp")  # checkpoints from before --strategy existed are FSDP2's
    if written_with == strategy:
        return None
    return (
        f"checkpoint at step {meta.get('step')} in {root} was written with --strategy {written_with}, "
        f"this run uses --strategy {strategy}; resume with --strategy {written_with} or point --ckpt_path "
        f"elsewhere"
    )


def architecture_problem(
    meta: dict[str, Any], key: str, model: nn.Module, root: str, what: str = "policy"
) -> str | None:
    """Why the fingerprint of the `what` model stored under meta[key] does not fit `model` (None: it fits)."""
    mine, theirs = fingerprint(model), meta.get(key, {})
    if mine["digest"] == theirs.get("digest"):
        return None
    a, b = mine["shapes"], theirs.get("shapes", {})
    only_ckpt = sorted(set(b) - set(a))[:3]
    only_model = sorted(set(a) - set(b))[:3]
    shape = [f"{n}: checkpoint {b[n]} vs model {a[n]}" for n in sorted(set(a) & set(b)) if a[n] != b[n]][:3]
    return (
        f"checkpoint at step {meta.get('step')} in {root} was written for a different {what} architecture "
        f"({theirs.get('num_params')} parameter tensors vs {mine['num_params']}; only in checkpoint: {only_ckpt}; "
        f"only in model: {only_model}; shape differs: {shape}). Point --ckpt_path elsewhere or load the same "
        f"model."
    )
