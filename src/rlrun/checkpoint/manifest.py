"""What a sealed checkpoint promises about its files, and checking that promise.

The manifest (``COMPLETE.json``'s ``files``) records, for every file of the checkpoint, its size and a
CRC-32 of its bytes. CRC-32 because it is what a checkpoint needs: it catches torn writes, truncation
and flipped or overwritten bytes (not tampering, which needs a signature, not a hash), and zlib computes
it at a few GB/s while releasing the GIL, so ranks can check their share of the files in parallel.
Format 1 manifests (sizes only, before checksums) still load, with sizes checked.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

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
