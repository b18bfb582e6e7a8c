"""rlrun's own cache folder (RLRUN_CACHE): things built once per machine and reused by every later run (the tiny-vl
preset, GGUF checkpoints dequantised into HF folders)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable


def cache_root() -> str:
    """RLRUN_CACHE, else ~/.cache/rlrun."""
    return os.environ.get("RLRUN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rlrun")


def built_once(final: str, build: Callable[[str], object]) -> str:
    """`final`, built by `build(folder)` unless it exists. Every rank may call this at once: each builds into its
    own scratch folder and renames it into place; the first rename wins and the others' copies are dropped, so a
    reader never sees a half-written folder (the builds must be deterministic)."""
    if os.path.isdir(final):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(final))
    try:
        build(scratch)
        try:
            os.rename(scratch, final)
        except OSError:
            if not os.path.isdir(final):  # not another rank's finished folder: a real failure
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final
