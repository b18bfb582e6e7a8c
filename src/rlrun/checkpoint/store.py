"""Checkpoint directories on disk: atomic publication, validation, discovery, retention.

A checkpoint is written into ``<root>/.tmp_step_N``; when every rank has written its part, rank 0
records a manifest (every file and its size) in ``COMPLETE.json``, flushes, renames the
directory to ``<root>/step_N`` and only then moves the ``latest`` pointer. A process killed at any
moment leaves either the old or the new checkpoint usable: a directory without a valid manifest
is never loaded, and old checkpoints are deleted only after the new one is complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

from rlrun.runtime.errors import RlrunError

COMPLETE = "COMPLETE.json"
LATEST = "latest"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RlrunError):
    """A checkpoint cannot be used (incomplete, corrupt or from an incompatible model)."""


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def tmp_dir(root: str, step: int) -> str:
    return os.path.join(root, f".tmp_step_{step:08d}")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def prepare(root: str, step: int) -> str:
    """Rank 0, before anyone writes: a fresh, empty temporary directory for this step."""
    try:
        os.makedirs(root, exist_ok=True)
        path = tmp_dir(root, step)
        shutil.rmtree(path, ignore_errors=True)  # a previous attempt's leftovers
        os.makedirs(path)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoints to --ckpt_path {root}: {exc.strerror}; "
                              "choose a writable directory") from None
    return path


def _manifest(path: str) -> dict[str, int]:
    files = {}
    for dirpath, _, names in os.walk(path):
        for name in names:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, path)
            if rel != COMPLETE:
                files[rel] = os.path.getsize(full)
    return files


def _fsync_tree(path: str) -> None:
    for dirpath, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(dirpath)


def publish(root: str, step: int, meta: dict[str, Any], keep: int) -> str:
    """Rank 0, after every rank has written its part: seal, rename, move the pointer, prune."""
    tmp, final = tmp_dir(root, step), step_dir(root, step)
    _fsync_tree(tmp)
    write_json_atomic(os.path.join(tmp, COMPLETE), {"format": FORMAT_VERSION, "step": step, "meta": meta,
                                                    "files": _manifest(tmp)})
    _fsync_dir(tmp)
    if os.path.exists(final):  # the same step saved again after a restart
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    write_json_atomic(os.path.join(root, LATEST), {"step": step, "path": os.path.basename(final)})
    prune(root, keep, current=step)
    return final


def validate(path: str) -> dict[str, Any]:
    """The sealed record of a checkpoint directory, or CheckpointError saying what is wrong."""
    marker = os.path.join(path, COMPLETE)
    try:
        with open(marker, encoding="utf-8") as fh:
            record = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {COMPLETE} (the save did not finish)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable {COMPLETE}: {exc}") from None
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict) or not isinstance(record.get("meta"), dict):
        raise CheckpointError(f"{path}: {COMPLETE} is not a checkpoint manifest")
    if record.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {record.get('format')} is not {FORMAT_VERSION}")
    for rel, size in record["files"].items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"{path}: file {rel} is missing")
        if os.path.getsize(full) != size:
            raise CheckpointError(f"{path}: file {rel} has {os.path.getsize(full)} bytes, expected {size}")
    return record


@dataclass(frozen=True)
class Found:
    path: str
    step: int
    meta: dict[str, Any]


def find_latest(root: str) -> tuple[Found | None, list[str]]:
    """The newest valid checkpoint under root (None if there is none) and a warning per skipped one."""
    warnings: list[str] = []
    if not os.path.isdir(root):
        return None, warnings
    names = sorted(os.listdir(root))
    for name in names:
        if name.startswith(".tmp_step_"):
            warnings.append(f"skipping checkpoint {os.path.join(root, name)}: a save that did not finish")
    steps = sorted((int(m.group(1)), name) for name in names if (m := _STEP_DIR.match(name)))
    for step, name in reversed(steps):
        path = os.path.join(root, name)
        try:
            record = validate(path)
        except CheckpointError as exc:
            warnings.append(f"skipping checkpoint {exc}")
            continue
        return Found(path, step, record["meta"]), warnings
    return None, warnings


def prune(root: str, keep: int, current: int | None = None) -> None:
    """Delete all but the newest `keep` complete checkpoints, and stale temporary directories.

    With `current` (the step just published), step directories numbered above it are deleted too:
    they are from an abandoned run (or were skipped as corrupt when this run resumed), and left in
    place they would push the new checkpoints out of the retention window and be picked on resume.
    """
    complete = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        m = _STEP_DIR.match(name)
        if name.startswith(".tmp_step_") or (m and current is not None and int(m.group(1)) > current):
            shutil.rmtree(path, ignore_errors=True)
        elif m and os.path.exists(os.path.join(path, COMPLETE)):
            complete.append((int(m.group(1)), path))
    complete.sort()
    for _, path in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
