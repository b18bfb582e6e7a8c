"""Phase tracking, a hang watchdog, and opt-in fault injection for failure tests.

The watchdog: if one phase runs longer than the collective timeout allows, every thread's
Python stack is written to stderr and the process exits non-zero (a hung rank never outlives
its peers). A rank that has been in one phase for more than half the collective timeout also
writes its stacks if the launcher stops it (SIGTERM) — usually because a peer's collective timed
out waiting for it — so the rank that hung shows where.

Fault injection: RLRUN_FAULT="phase:step:rank[:kill|raise|hang]" makes that rank SIGKILL itself (or
raise, or never return) when it reaches the phase at that step (0-based), on the first attempt only, so an
elastic restart can recover. Phases are those of the run (startup excepted) plus "save_shards": inside a
checkpoint save, after this rank wrote its shards and before the checkpoint is sealed. Nothing
happens when the variable is unset.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from rlrun.runtime.memory import PHASE_PEAKS


def run_phases(rank: int, dist_timeout: float) -> "PhaseTracker":
    """The tracker of one training run. Collectives time out at dist_timeout; a phase stuck well past that is a
    hang: dump stacks, exit. A rank stopped by the launcher after half the timeout in one phase dumps its stacks:
    it is the likely hang."""
    return PhaseTracker(rank, hang_after_s=dist_timeout * 1.5 + 10, dump_on_term_after_s=dist_timeout * 0.5)


# A run's close (its process groups torn down, then the process's exit: atexit handlers, interpreter finalization)
# takes seconds. Past this it is hung: a finished run must not hold its launcher, or a CI job, forever.
CLOSE_BOUND_S = 120.0


def _arm_watchdog(seconds: float) -> None:
    """Past `seconds` (until cancel_dump_traceback_later), every thread's stack goes to stderr and the process exits
    1: faulthandler's own thread, so it fires even when the hang holds the GIL. One per process: arming replaces."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)


@contextmanager
def bounded_close() -> Iterator[None]:
    """Bound the body as the phase watchdog bounds a phase, at CLOSE_BOUND_S."""
    _arm_watchdog(CLOSE_BOUND_S)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def bound_exit() -> None:
    """Bound what is left of this process (it is about to exit): as `bounded_close`, never disarmed."""
    _arm_watchdog(CLOSE_BOUND_S)


class InjectedFault(Exception):
    """Raised by RLRUN_FAULT=...:raise."""


@dataclass
class PhaseTracker:
    rank: int
    hang_after_s: float
    phase: str = "startup"
    step: int = -1
    # After this long in one phase, SIGTERM dumps every thread's stack before the default action
    # (None: never). The arming runs on a daemon thread; disarmed again when the phase ends.
    dump_on_term_after_s: float | None = None
    _entered: float | None = field(default=None, repr=False)
    _armed: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _watcher: threading.Thread | None = field(default=None, repr=False)

    @contextmanager
    def __call__(self, phase: str, step: int) -> Iterator[None]:
        self.phase, self.step = phase, step
        _arm_watchdog(self.hang_after_s)
        with self._lock:
            self._entered = time.monotonic()
        self._start_watcher()
        PHASE_PEAKS.enter(phase)
        try:
            maybe_inject(phase, step, self.rank)
            yield
        finally:
            PHASE_PEAKS.exit(phase)
            faulthandler.cancel_dump_traceback_later()
            with self._lock:
                self._entered = None
                if self._armed:
                    faulthandler.unregister(signal.SIGTERM)
                    self._armed = False

    def _start_watcher(self) -> None:
        if self.dump_on_term_after_s is None or self._watcher is not None:
            return
        self._watcher = threading.Thread(target=self._watch, name="rlrun-phase-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        assert self.dump_on_term_after_s is not None
        poll = min(0.5, self.dump_on_term_after_s / 4)
        while True:
            time.sleep(poll)
            with self._lock:
                if (self._entered is not None and not self._armed
                        and time.monotonic() - self._entered >= self.dump_on_term_after_s):
                    # chain=True: after the dump the previous (default) action still ends the process.
                    faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)
                    self._armed = True


def maybe_inject(phase: str, step: int, rank: int) -> None:
    spec = os.environ.get("RLRUN_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    parts = spec.split(":")
    if parts[:3] != [phase, str(step), str(rank)]:
        return
    mode = parts[3] if len(parts) > 3 else "kill"
    if mode == "raise":
        raise InjectedFault(f"injected fault (RLRUN_FAULT={spec})")
    if mode == "hang":  # stuck where no bound of rlrun's reaches: only the watchdog ends it
        while True:
            time.sleep(3600)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
