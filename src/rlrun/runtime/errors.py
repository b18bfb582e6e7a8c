"""Exception types. Each message names the offending value and how to fix it."""

from __future__ import annotations

import errno
import os
import shutil


class RlrunError(Exception):
    """Base class for errors rlrun reports as one clear message and a non-zero exit."""


class ConfigError(RlrunError, ValueError):
    """A flag, YAML key or value is invalid. Raised before anything expensive starts."""


class LayoutError(RlrunError, ValueError):
    """The requested role layout does not fit the world size / ranks per node."""


class DataError(RlrunError, ValueError):
    """The prompt dataset is missing, empty, or lacks a requested key."""


class RewardError(RlrunError):
    """A reward source failed: import error, exception, wrong length/type, NaN, HTTP failure."""


class AgentError(RlrunError):
    """A multi-turn agent failed: its file, an exception in reset()/step(), a malformed result, a timeout."""


class MissingExtraError(RlrunError, ImportError):
    """An optional dependency (vllm, deepspeed, flash-attn, wandb, ...) is not installed."""

    def __init__(self, package: str, extra: str, feature: str) -> None:
        super().__init__(
            f"{feature} needs the optional package '{package}', which is not installed. "
            f"Install it with: pip install 'rlrun[{extra}]'"
        )
        self.package = package
        self.extra = extra


class StorageError(RlrunError):
    """The disk refused a write: full, over quota, read-only, no permission. The message names the path, the
    system's reason and the space needed."""


class NonFiniteError(RlrunError):
    """A model's weights or outputs are NaN/inf: the run diverged (or loaded damaged weights)."""


class CheckpointError(RlrunError):
    """A checkpoint cannot be used (incomplete, corrupt or from an incompatible model)."""


# ---- storage failures --------------------------------------------------------------------------------------------
# Turning a refused write (disk full, quota, read-only filesystem, permission) into one line that says where,
# why, and how much space the write needs, wherever it surfaced: a plain OSError, or one that torch's DCP
# wrapped per rank in a CheckpointException (a BaseException carrying `failures`).

# What the storage itself refuses; the same write fails again until a person acts.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG, errno.EIO})


def storage_cause(exc: BaseException) -> OSError | None:
    """The OSError with a storage errno behind `exc` (through causes, contexts and DCP's per-rank failures)."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in STORAGE_ERRNOS:
            return current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):  # torch.distributed.checkpoint's CheckpointException: rank -> (exc, tb)
            todo.extend(pair[0] for _, pair in sorted(failures.items()) if isinstance(pair, tuple) and pair)
        todo.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return None


def free_bytes(path: str) -> int | None:
    """Free space on the filesystem that holds `path` (or its nearest existing parent)."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def storage_error(what: str, path: str, cause: OSError, needs_bytes: int | None, fix: str) -> StorageError:
    """One line: `what` could not be written to `path`, the system's reason (and the file), the space the write
    needs and what is free, and `fix`."""
    reason = cause.strerror or str(cause)
    where = f", writing {cause.filename}" if cause.filename and str(cause.filename) != path else ""
    free = free_bytes(path)
    space = ""
    if cause.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        space = (f"; it needs about {_mb(needs_bytes)}" if needs_bytes else "") + (
            f", {_mb(free)} free there" if free is not None else ""
        )
    return StorageError(f"cannot write {what} to {path}: {reason} (errno {cause.errno}{where}){space}; {fix}")


def brief(exc: BaseException, limit: int = 300) -> str:
    """`Type: message` on one line; for DCP's CheckpointException, its ranks' own errors (not its tracebacks)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        seen: dict[str, list[int]] = {}
        for rank, pair in sorted(failures.items()):
            inner = pair[0] if isinstance(pair, tuple) and pair else pair
            seen.setdefault(brief(inner, limit) if isinstance(inner, BaseException) else str(inner), []).append(rank)
        return "; ".join(f"rank {','.join(map(str, ranks))}: {text}" for text, ranks in seen.items())[:limit]
    text = " ".join(str(exc).split())
    return (f"{type(exc).__name__}: {text}" if text else type(exc).__name__)[:limit]
