"""The collective part of saving and finding checkpoints, shared by every trainer.

Rank 0 of the world prepares the temporary directory and seals it (rlrun.checkpoint.store); every rank writes
its own part in between; a failure to prepare or a checkpoint that does not fit the run is one error on
every rank (broadcast), never a rank waiting alone.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from rlrun.checkpoint import store as ckpt
from rlrun.launch.dcp import barrier
from rlrun.launch.transfer import broadcast_json
from rlrun.runtime.faults import maybe_inject
from rlrun.runtime.log import get_logger


def save_checkpoint(root: str, steps_done: int, *, group: dist.ProcessGroup, device: torch.device, timeout_s: float,
                    keep: int, write: Callable[[str], None], meta: Callable[[], dict[str, Any]]) -> None:
    """Collective over `group` (every rank of the world, rank 0 first). `write(tmp_path)` runs on every rank
    and writes that rank's part; `meta()` (rank 0) describes the checkpoint for its manifest."""
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
    error = broadcast_json(error, 0, group, device)
    if error:
        raise ckpt.CheckpointError(error)
    write(path)
    # A kill here leaves a half-written directory. (Not "save": the PhaseTracker already injects "save"
    # faults on entering the save phase, before anything is written, so it would never get here.)
    maybe_inject("save_shards", steps_done - 1, rank)
    barrier(group, timeout_s)  # every part is on disk before the checkpoint is sealed
    if rank == 0:
        final = ckpt.publish(root, steps_done, meta(), keep)
        size_mb = sum(ckpt.validate(final)["files"].values()) / 2**20
        log.info_once(f"checkpoint saved: {final} ({size_mb:.1f} MB in {time.perf_counter() - start:.2f} s)")
    barrier(group, timeout_s)


def find_checkpoint(root: str, *, group: dist.ProcessGroup, device: torch.device,
                    problem: Callable[[dict[str, Any]], str | None]) -> tuple[str, int] | None:
    """(path, step) of the newest complete checkpoint in `root` on every rank of `group`, or None. Collective.
    `problem(meta)` (rank 0) says why a found checkpoint does not fit this run: a CheckpointError everywhere."""
    rank = dist.get_rank()
    log = get_logger(rank)
    choice: Any = None
    if rank == 0:
        found, warnings = ckpt.find_latest(root)
        for line in warnings:
            log.warning_once(line)
        if found is not None:
            why = problem(found.meta)
            choice = {"error": why} if why else {"path": found.path, "step": found.step}
    choice = broadcast_json(choice, 0, group, device)
    if choice is None:
        log.info_once(f"--load_checkpoint: no complete checkpoint in {root}; starting fresh")
        return None
    if "error" in choice:
        raise ckpt.CheckpointError(choice["error"])
    return choice["path"], int(choice["step"])
