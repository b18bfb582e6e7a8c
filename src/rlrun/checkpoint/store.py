"""Checkpoint directories on disk: atomic publication, validation, discovery, retention.

A checkpoint is written into ``<root>/.tmp_step_N``; when every rank has written its part, rank 0
records a manifest (every file, its size and CRC-32: rlrun.checkpoint.store) in ``COMPLETE.json``,
flushes, renames the directory to ``<root>/step_N`` and only then moves the ``latest`` pointer. A process
killed at any moment leaves either the old or the new checkpoint usable: a directory without a valid
manifest is never loaded, and old checkpoints are deleted only after the new one is complete.

Every checkpoint records the run that wrote it (``meta["run"]``: an id and the config digest). Pruning
removes only the writing run's own checkpoints older than the ones it keeps; another run's checkpoints,
and any newer than the one just saved, are left alone unless the run was started with
--overwrite_checkpoints (rlrun.checkpoint.resume decides that before anything runs).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlrun.runtime.errors import CheckpointError

# ---- the manifest ------------------------------------------------------------------------------------------------
# What a sealed checkpoint promises about its files, and checking that promise.
#
# The manifest (``COMPLETE.json``'s ``files``) records, for every file of the checkpoint, its size and a
# CRC-32 of its bytes. CRC-32 because it is what a checkpoint needs: it catches torn writes, truncation
# and flipped or overwritten bytes (not tampering, which needs a signature, not a hash), and zlib computes
# it at a few GB/s while releasing the GIL, so ranks can check their share of the files in parallel.
# Format 1 manifests (sizes only, before checksums) still load, with sizes checked.

CHUNK_BYTES = 8 * 2**20


def file_crc32(path: str) -> str:
    """The CRC-32 of a file's bytes, as 8 hex digits."""
    crc = 0
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(CHUNK_BYTES)
        view = memoryview(buf)
        while n := fh.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def list_files(path: str, skip: Iterable[str] = ()) -> list[str]:
    """Every file under `path`, relative to it, sorted (the order every rank agrees on)."""
    skipped = set(skip)
    out = []
    for dirpath, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), path)
            if rel not in skipped:
                out.append(rel)
    return sorted(out)


def describe(path: str, names: Iterable[str], crcs: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Manifest entries for `names` under `path`: size, and the CRC-32 (taken from `crcs` where given,
    computed here otherwise)."""
    out = {}
    for rel in names:
        full = os.path.join(path, rel)
        crc = crcs[rel] if crcs is not None and rel in crcs else file_crc32(full)
        out[rel] = {"bytes": os.path.getsize(full), "crc32": crc}
    return out


def size_problem(path: str, rel: str, entry: Any) -> str | None:
    """Why file `rel` of the checkpoint at `path` does not match its manifest entry by existence and size."""
    expected = entry if isinstance(entry, int) else entry.get("bytes") if isinstance(entry, dict) else None
    if not isinstance(expected, int):
        return f"the manifest entry of {rel} is not a size"
    full = os.path.join(path, rel)
    if not os.path.isfile(full):
        return f"file {rel} is missing"
    actual = os.path.getsize(full)
    if actual != expected:
        return f"file {rel} has {actual} bytes, expected {expected}"
    return None


def content_problem(path: str, rel: str, entry: Any) -> str | None:
    """Why the bytes of file `rel` do not match the CRC-32 its manifest entry records (None: they do, or
    the entry predates checksums). Reads the whole file."""
    expected = entry.get("crc32") if isinstance(entry, dict) else None
    if expected is None:
        return None
    try:
        actual = file_crc32(os.path.join(path, rel))
    except OSError as exc:
        return f"file {rel} cannot be read ({exc.strerror or exc})"
    if actual != expected:
        return f"file {rel} has CRC-32 {actual}, the manifest says {expected} (its bytes changed after the save)"
    return None


def manifest_bytes(files: Mapping[str, Any]) -> int:
    """Total size of a checkpoint from its manifest (either format)."""
    return sum(e if isinstance(e, int) else int(e.get("bytes", 0)) for e in files.values())


COMPLETE = "COMPLETE.json"
LATEST = "latest"
FORMAT_VERSION = 2  # 2: files carry {"bytes", "crc32"}; 1: a size per file
READABLE_FORMATS = (1, 2)
_STEP_DIR = re.compile(r"^step_(\d+)$")


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
        raise CheckpointError(
            f"cannot write checkpoints to --ckpt_path {root}: {exc.strerror}; choose a writable directory"
        ) from None
    return path


def _fsync_tree(path: str) -> None:
    for dirpath, _, names in os.walk(path):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(dirpath)


def publish(
    root: str,
    step: int,
    meta: dict[str, Any],
    keep: int,
    *,
    crcs: dict[str, str] | None = None,
    remove_foreign: bool = False,
) -> str:
    """Rank 0, after every rank has written its part: seal, rename, move the pointer, prune (`prune`).
    `crcs`: the files' CRC-32s where the ranks computed them (the rest are computed here)."""
    tmp, final = tmp_dir(root, step), step_dir(root, step)
    _fsync_tree(tmp)
    files = describe(tmp, list_files(tmp, skip=[COMPLETE]), crcs)
    write_json_atomic(
        os.path.join(tmp, COMPLETE), {"format": FORMAT_VERSION, "step": step, "meta": meta, "files": files}
    )
    _fsync_dir(tmp)
    if os.path.exists(final):  # the same step saved again after a restart
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    write_json_atomic(os.path.join(root, LATEST), {"step": step, "path": os.path.basename(final)})
    prune(root, keep, run_of(meta), current=step, remove_foreign=remove_foreign)
    return final


def run_of(meta: dict[str, Any]) -> str | None:
    """The id of the run that wrote a checkpoint (None: written before runs were recorded)."""
    run = meta.get("run")
    return run.get("id") if isinstance(run, dict) else None


def validate(path: str) -> dict[str, Any]:
    """The sealed record of a checkpoint directory, or CheckpointError saying what is wrong. Checks the
    manifest and every file's presence and size; the bytes are checked by manifest.content_problem."""
    marker = os.path.join(path, COMPLETE)
    try:
        with open(marker, encoding="utf-8") as fh:
            record = json.load(fh)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no {COMPLETE} (the save did not finish)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable {COMPLETE}: {exc}") from None
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("files"), dict)
        or not isinstance(record.get("meta"), dict)
    ):
        raise CheckpointError(f"{path}: {COMPLETE} is not a checkpoint manifest")
    if record.get("format") not in READABLE_FORMATS:
        raise CheckpointError(
            f"{path}: checkpoint format {record.get('format')} is not one of {READABLE_FORMATS} "
            "(written by another rlrun version)"
        )
    for rel, entry in record["files"].items():
        problem = size_problem(path, rel, entry)
        if problem:
            raise CheckpointError(f"{path}: {problem}")
    return record


@dataclass(frozen=True)
class Found:
    path: str
    step: int
    meta: dict[str, Any]
    files: dict[str, Any]

    @property
    def run(self) -> str | None:
        return run_of(self.meta)


def step_dirs(root: str) -> list[tuple[int, str]]:
    """(step, path) of every step_N entry under root, newest first (whatever its state)."""
    if not os.path.isdir(root):
        return []
    steps = sorted((int(m.group(1)), name) for name in os.listdir(root) if (m := _STEP_DIR.match(name)))
    return [(step, os.path.join(root, name)) for step, name in reversed(steps)]


def find_latest(root: str, exclude: Collection[str] = ()) -> tuple[Found | None, list[str]]:
    """The newest checkpoint under root that passes `validate` and is not in `exclude` (None if there is
    none), and a warning per unfinished save and per newer checkpoint skipped. Reads no file contents:
    rlrun.checkpoint.collective verifies the bytes before anything is loaded."""
    warnings = [
        f"skipping checkpoint {os.path.join(root, name)}: a save that did not finish"
        for name in (sorted(os.listdir(root)) if os.path.isdir(root) else [])
        if name.startswith(".tmp_step_")
    ]
    for step, path in step_dirs(root):
        if path in exclude:
            continue
        try:
            record = validate(path)
        except CheckpointError as exc:
            warnings.append(f"skipping checkpoint {exc}")
            continue
        return Found(path, step, record["meta"], record["files"]), warnings
    return None, warnings


def prune(root: str, keep: int, run: str | None, current: int | None = None, remove_foreign: bool = False) -> None:
    """Delete stale temporary directories, and all but the newest `keep` complete checkpoints of run `run`
    at or below step `current`. Never a newer checkpoint (one this run skipped when it resumed stays for a
    person to look at) nor another run's, unless `remove_foreign` (--overwrite_checkpoints): then every
    checkpoint of another run goes, now that this run has one of its own."""
    own = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        m = _STEP_DIR.match(name)
        if name.startswith(".tmp_step_"):
            shutil.rmtree(path, ignore_errors=True)
            continue
        if not m or not os.path.isdir(path):
            continue
        step = int(m.group(1))
        sealed, writer = writer_of(path)
        if not sealed:
            continue  # not a checkpoint (yet): never counted, never deleted
        if writer == run:
            if current is None or step <= current:
                own.append((step, path))
        elif remove_foreign:
            shutil.rmtree(path, ignore_errors=True)
    own.sort()
    for _, path in own[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)


def writer_of(path: str) -> tuple[bool, str | None]:
    """(whether a step directory is sealed: a readable manifest, the id of the run that wrote it)."""
    try:
        with open(os.path.join(path, COMPLETE), encoding="utf-8") as fh:
            meta = json.load(fh)["meta"]
    except (OSError, ValueError, KeyError, TypeError):
        return False, None
    return True, run_of(meta) if isinstance(meta, dict) else None
