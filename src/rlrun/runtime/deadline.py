"""A bound rlrun sets on a call it cannot interrupt: user reward code, data loading.

The call runs where it would anyway (the main thread: user code may rely on signals, as math checkers that
use `signal.alarm` do); a timer thread waits beside it. When the bound passes first, the timer hands the error
the caller described to the process's failure reporter, which prints the run's one FAILED line and ends the
process (no thread can stop a call stuck in C or on a dead filesystem, so leaving is the only bounded answer).
Runs register their reporter at start (rlrun.launch.failures); the default prints the error and exits 1.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def _default_reporter(exc: BaseException) -> None:
    sys.stderr.write(f"error: {type(exc).__name__}: {exc}\n")
    sys.stderr.flush()
    os._exit(1)


_reporter: Callable[[BaseException], None] = _default_reporter


def set_reporter(report: Callable[[BaseException], None]) -> None:
    """What happens when a deadline passes: `report(error)` must not return (it ends the process)."""
    global _reporter
    _reporter = report


def report_fatal(exc: BaseException) -> None:
    """Hand `exc` to the failure reporter and end the process (from any thread: the watchdogs' way out)."""
    _expire(lambda: exc)


def _expire(error: Callable[[], BaseException]) -> None:
    try:
        exc = error()
    except Exception as failure:  # noqa: BLE001 - the message itself failed; still leave, still say why
        exc = TimeoutError(f"a deadline passed (and describing it failed: {failure})")
    _reporter(exc)
    os._exit(1)  # a reporter that returned: the bound still holds


@contextmanager
def deadline(seconds: float | None, error: Callable[[], BaseException]) -> Iterator[None]:
    """Bound the body to `seconds` (None: unbounded). Past it, `error()` goes to the failure reporter."""
    if seconds is None:
        yield
        return
    timer = threading.Timer(seconds, _expire, args=(error,))
    timer.daemon = True
    timer.name = "rlrun-deadline"
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
