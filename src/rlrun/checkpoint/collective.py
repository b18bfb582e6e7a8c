"""The collective part of saving and finding checkpoints, shared by every trainer.

Rank 0 of the world prepares the temporary directory and seals it (rlrun.checkpoint.store); every rank writes
its own part in between, then checksums its share of the files (rlrun.checkpoint.store), so the manifest
costs one parallel read of what was just written. Before a checkpoint is loaded every rank re-checks its share
of the bytes; one that fails is skipped for the next newest, said once. A failure to prepare, write or seal,
or a checkpoint that does not fit the run, is one error on every rank (agreed by a collective), never a rank
waiting alone.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from rlrun.checkpoint import store as ckpt
from rlrun.checkpoint import store as manifest
from rlrun.launch.transfer import broadcast_json, sum_over
from rlrun.runtime.errors import StorageError, brief, storage_cause, storage_error
from rlrun.runtime.log import get_logger
from rlrun.runtime.phases import maybe_inject


def barrier(group: dist.ProcessGroup, timeout_s: float) -> None:
    # monitored_barrier names the rank that did not arrive (gloo only); NCCL gets a plain barrier.
    if dist.get_backend(group) == "gloo":
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s))
    else:
        dist.barrier(group=group)


T = TypeVar("T")

STORAGE_FIX = "free space there, or point --ckpt_path at a filesystem with room (older checkpoints are intact)"


def _agree_on_error(error: str | None, group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Collective: the first failing rank's message on every rank (None when no rank failed)."""
    world = dist.get_world_size(group)
    flags = [0.0] * world
    flags[dist.get_rank(group)] = 1.0 if error else 0.0
    failed = [i for i, f in enumerate(sum_over(flags, group, device)) if f > 0]
    if not failed:
        return None
    src = dist.get_global_rank(group, failed[0])
    message = broadcast_json(error if dist.get_rank() == src else None, src, group, device)
    return str(message)


def _storage_message(exc: BaseException, root: str, step: int, needs_bytes: int | None) -> str:
    """The one-line message of a refused checkpoint write (`exc` re-raised when the storage did not refuse it)."""
    cause = storage_cause(exc)
    if cause is None:
        raise exc
    newest, _ = ckpt.find_latest(root)
    size = manifest.manifest_bytes(newest.files) if newest is not None else needs_bytes
    return str(storage_error(f"checkpoint step {step}", ckpt.tmp_dir(root, step), cause, size, STORAGE_FIX))


def write_parts(*parts: Callable[[], None]) -> None:
    """Run one rank's parts of a checkpoint write in order. A part the storage refuses is remembered and the
    remaining parts still run, since they hold collectives every rank must enter; the first refusal is raised
    at the end (save_checkpoint turns it into one line on every rank). Any other error is raised at once."""
    refused: BaseException | None = None
    for part in parts:
        try:
            part()
        except BaseException as exc:
            if storage_cause(exc) is None:
                raise
            refused = refused or exc
    if refused is not None:
        raise refused


def _checksums(path: str, group: dist.ProcessGroup, device: torch.device) -> dict[str, str]:
    """Collective: the CRC-32 of every file under `path`, each file read by one rank."""
    names = broadcast_json(
        manifest.list_files(path, skip=[ckpt.COMPLETE]) if dist.get_rank() == 0 else None, 0, group, device
    )
    assert isinstance(names, list)
    me, world = dist.get_rank(group), dist.get_world_size(group)
    values = [
        float(int(manifest.file_crc32(os.path.join(path, n)), 16)) if i % world == me else 0.0
        for i, n in enumerate(names)
    ]
    return {n: f"{int(v):08x}" for n, v in zip(names, sum_over(values, group, device) if names else [])}


def save_checkpoint(
    root: str,
    steps_done: int,
    *,
    group: dist.ProcessGroup,
    device: torch.device,
    timeout_s: float,
    keep: int,
    write: Callable[[str], None],
    meta: Callable[[], dict[str, Any]],
    remove_foreign: bool = False,
    needs_bytes: int | None = None,
) -> None:
    """Collective over `group` (every rank of the world, rank 0 first). `write(tmp_path)` runs on every rank
    and writes that rank's part (it must take part in every collective of the save even when a write of its
    own failed, and raise the storage error at the end); `meta()` (rank 0) describes the checkpoint for its
    manifest (see write_parts). `remove_foreign`: delete other runs' checkpoints once this one is sealed
    (--overwrite_checkpoints). `needs_bytes`: the expected size for a disk-full message when `root` holds no
    checkpoint to tell it."""
    rank = dist.get_rank()
    log = get_logger(rank)
    path = ckpt.tmp_dir(root, steps_done)
    start = time.perf_counter()
    error = None
    if rank == 0:
        try:
            ckpt.prepare(root, steps_done)
        except ckpt.CheckpointError as exc:
            error = str(exc)
    # Every rank learns whether the directory exists before anyone writes into it.
    error = cast("str | None", broadcast_json(error, 0, group, device))
    if error:
        raise ckpt.CheckpointError(error)
    try:
        write(path)
    except BaseException as exc:  # noqa: BLE001 - a refused write is agreed on below; anything else re-raises
        error = _storage_message(exc, root, steps_done, needs_bytes)
    if (error := _agree_on_error(error, group, device)) is not None:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        raise StorageError(error)
    # A kill here leaves a half-written directory. (Not "save": the PhaseTracker already injects "save"
    # faults on entering the save phase, before anything is written, so it would never get here.)
    maybe_inject("save_shards", steps_done - 1, rank)
    barrier(group, timeout_s)  # every part is on disk before the checkpoint is sealed
    hashed = time.perf_counter()
    crcs = _checksums(path, group, device)
    hash_s = time.perf_counter() - hashed
    if rank == 0:
        try:
            final = ckpt.publish(root, steps_done, meta(), keep, crcs=crcs, remove_foreign=remove_foreign)
        except OSError as exc:
            shutil.rmtree(path, ignore_errors=True)
            error = _storage_message(exc, root, steps_done, needs_bytes)
    if (error := cast("str | None", broadcast_json(error, 0, group, device))) is not None:
        raise StorageError(str(error))
    if rank == 0:
        size_mb = manifest.manifest_bytes(ckpt.validate(final)["files"]) / 2**20
        log.info_once(
            f"checkpoint saved: {final} ({size_mb:.1f} MB in {time.perf_counter() - start:.2f} s, "
            f"checksums {hash_s:.2f} s)"
        )
    barrier(group, timeout_s)


@dataclass(frozen=True)
class Resumable:
    """The checkpoint a run continues from, known to every rank."""

    path: str
    step: int
    run: str | None  # the id of the run that wrote it (this run continues it)
    verify_s: float = 0.0  # reading the checkpoint back to check its checksums


def _verified(found: ckpt.Found | None, group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Collective: why the bytes of `found` (rank 0's choice) do not match its manifest (None: they do). Each
    rank reads its share of the files."""
    listing = broadcast_json(None if found is None else [found.path, sorted(found.files.items())], 0, group, device)
    assert isinstance(listing, list)
    path, entries = listing
    me, world = dist.get_rank(group), dist.get_world_size(group)
    problems = [
        manifest.content_problem(path, rel, entry) if i % world == me else None
        for i, (rel, entry) in enumerate(entries)
    ]
    bad = [i for i, flag in enumerate(sum_over([1.0 if p else 0.0 for p in problems], group, device)) if flag > 0]
    if not bad:
        return None
    return str(broadcast_json(problems[bad[0]], dist.get_global_rank(group, bad[0] % world), group, device))


@dataclass
class Skipped:
    """What one search for a checkpoint set aside (rank 0 keeps the reasons): every warning is said once,
    however many times the search restarts after a checkpoint fails to load."""

    paths: list[str] = field(default_factory=list)  # never offered again
    reasons: list[str] = field(default_factory=list)  # "PATH: why", for the error when nothing is left
    said: set[str] = field(default_factory=set)

    def add(self, path: str | None, reason: str, log: Any) -> None:
        line = f"skipping checkpoint {reason}"
        if line in self.said:
            return
        self.said.add(line)
        log.warning_once(line)
        if path is not None:
            self.paths.append(path)
            self.reasons.append(reason)


def find_checkpoint(
    root: str,
    *,
    group: dist.ProcessGroup,
    device: torch.device,
    problem: Callable[[dict[str, Any]], str | None],
    skipped: Skipped | None = None,
) -> Resumable | None:
    """The newest checkpoint in `root` whose files are intact on every rank of `group`, or None when `root` holds
    no checkpoint at all. Collective. Checkpoints that fail are skipped with one warning each (into `skipped`,
    which also holds those the caller set aside); when some exist and none is left, one CheckpointError on every
    rank. `problem(meta)` (rank 0) says why an intact checkpoint does not fit this run: a CheckpointError everywhere."""
    rank = dist.get_rank()
    log = get_logger(rank)
    skipped = skipped if skipped is not None else Skipped()
    verify_s = 0.0
    while True:
        choice: Any = None
        found = None
        if rank == 0:
            found, warnings = ckpt.find_latest(root, exclude=skipped.paths)
            for line in warnings:
                reason = line.removeprefix("skipping checkpoint ")
                unfinished = ".tmp_step_" in reason  # an unfinished save was never a checkpoint
                skipped.add(None if unfinished else reason.split(": ", 1)[0], reason, log)
            choice = None if found is None else {"path": found.path, "step": found.step, "run": found.run}
        choice = broadcast_json(choice, 0, group, device)
        if choice is None:
            break
        started = time.perf_counter()
        corrupt = _verified(found, group, device)
        verify_s += time.perf_counter() - started
        if corrupt is None:
            why = problem(found.meta) if rank == 0 and found is not None else None
            why = cast("str | None", broadcast_json(why, 0, group, device))
            if why:
                raise ckpt.CheckpointError(str(why))
            return Resumable(choice["path"], int(choice["step"]), choice["run"], verify_s)
        skipped.add(choice["path"], f"{choice['path']}: {corrupt}", log)
    reasons = broadcast_json(skipped.reasons, 0, group, device)
    assert isinstance(reasons, list)
    if reasons:
        shown = "; ".join(reasons[:3]) + (f"; and {len(reasons) - 3} more" if len(reasons) > 3 else "")
        raise ckpt.CheckpointError(
            f"--load_checkpoint: no intact checkpoint in {root} ({shown}); move the damaged checkpoints away to start "
            "over there, or start a new run with a fresh --ckpt_path"
        )
    log.info_once(f"--load_checkpoint: no complete checkpoint in {root}; starting fresh")
    return None


def restore_newest(
    root: str,
    *,
    group: dist.ProcessGroup,
    device: torch.device,
    problem: Callable[[dict[str, Any]], str | None],
    load: Callable[[str], T],
) -> tuple[Resumable, T] | None:
    """find_checkpoint, then `load(path)` on every rank; a checkpoint that fails to load on any rank (agreed by a
    collective) is skipped for the next newest, said once. None: `root` holds no checkpoint. Collective."""
    log = get_logger(dist.get_rank())
    skipped = Skipped()
    while True:
        found = find_checkpoint(root, group=group, device=device, problem=problem, skipped=skipped)
        if found is None:
            return None
        error = None
        try:
            loaded = load(found.path)
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            error = brief(exc)
        if not sum_over([1.0 if error else 0.0], group, device)[0]:
            return found, loaded
        skipped.add(found.path, f"{found.path}: loading it failed ({error or 'on another rank'})", log)
