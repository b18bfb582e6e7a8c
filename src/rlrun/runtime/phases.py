"""Where a rank is and how long it may stay there: the run's phases, the hang watchdog, deadlines on calls rlrun
cannot interrupt, and opt-in fault injection for failure tests.

Phases (`Phase`, entered with `with tracker(Phase.SCORE, step):`): the one mechanism every loop uses. Entering a
phase names it for the failure line a rank leaves, arms the watchdog, counts the phase's peak memory
(rlrun.runtime.memory), runs the phase hook a loop attached (the RL loop's: sleep and wake the models,
rlrun.rl.sleep) and adds the phase's seconds to what `took()` returns.

The watchdog: if one phase runs longer than the collective timeout allows, every thread's
Python stack is written to stderr and the process exits non-zero (a hung rank never outlives
its peers). A rank that has been in one phase for more than half the collective timeout also
writes its stacks if the launcher stops it (SIGTERM) — usually because a peer's collective timed
out waiting for it — so the rank that hung shows where.

Fault injection: RLRUN_FAULT="phase:step:rank[:kill|raise|hang|term]" makes that rank SIGKILL itself (or
raise, or never return, or send itself SIGTERM: a preemption notice heard there, rlrun.run.preemption) when it
reaches the phase at that step (0-based), on the first attempt only (neither an elastic restart nor a requeued Slurm
job), so a restart can recover. Phases are those of the run (startup excepted) plus "save_shards": inside a
checkpoint save, after this rank wrote its shards and before the checkpoint is sealed. Nothing
happens when the variable is unset.
"""

from __future__ import annotations

import enum
import faulthandler
import os
import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from rlrun.runtime.memory import PHASE_PEAKS, reuse_heap


class Phase(enum.Enum):
    """The phases of a run, in the order a step passes them. The value is the name failure lines, RLRUN_FAULT,
    the memory line and time/<name> use."""

    STARTUP = "startup"
    BUILD = "build"
    LOAD = "load"
    GENERATE = "generate"
    SCORE = "score"
    TRAIN = "train"  # the actor's update (a supervised trainer's: its model's)
    # The critic's update: a phase of its own so that sleep wakes the critic's optimizer state and not the actor's,
    # reported as "train" like the actor's.
    TRAIN_CRITIC = "train_critic"
    SYNC = "sync"
    EVAL = "eval"
    SAVE = "save"

    @property
    def reported(self) -> str:
        return Phase.TRAIN.value if self is Phase.TRAIN_CRITIC else self.value


# The phases that decode token by token (runtime.memory.reuse_heap: the heap serves them as glibc's default would).
DECODING = frozenset({Phase.GENERATE, Phase.EVAL})


def run_phases(rank: int, dist_timeout: float) -> PhaseTracker:
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
    """The phase this rank is in (for its failure line), the watchdog over it, and the seconds each phase took."""

    rank: int
    hang_after_s: float
    phase: str = Phase.STARTUP.value
    step: int = -1
    # After this long in one phase, SIGTERM dumps every thread's stack before the default action
    # (None: never). The arming runs on a daemon thread; disarmed again when the phase ends.
    dump_on_term_after_s: float | None = None
    # Run as each phase begins, inside it (a failure there is the phase's): the RL loop's sleep schedule.
    on_enter: Callable[[Phase], None] | None = None
    _seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float), repr=False)
    _entered: float | None = field(default=None, repr=False)
    _armed: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _watcher: threading.Thread | None = field(default=None, repr=False)

    def set(self, phase: Phase, step: int = -1) -> None:
        """Name `phase` for the failure line from now on, without a watchdog over it (start-up, building)."""
        self.phase, self.step = phase.reported, step

    @contextmanager
    def __call__(self, phase: Phase, step: int) -> Iterator[None]:
        name = phase.reported
        self.phase, self.step = name, step
        started = time.perf_counter()
        _arm_watchdog(self.hang_after_s)
        with self._lock:
            self._entered = time.monotonic()
        self._start_watcher()
        PHASE_PEAKS.enter(name)
        try:
            maybe_inject(name, step, self.rank)
            if self.on_enter is not None:
                self.on_enter(phase)
            if phase in DECODING:
                with reuse_heap():
                    yield
            else:
                yield
        finally:
            PHASE_PEAKS.exit(name)
            faulthandler.cancel_dump_traceback_later()
            with self._lock:
                self._entered = None
                if self._armed:
                    faulthandler.unregister(signal.SIGTERM)
                    self._armed = False
            self._seconds[name] += time.perf_counter() - started

    def took(self) -> dict[str, float]:
        """Seconds spent in each phase (by reported name) since the last call."""
        out, self._seconds = dict(self._seconds), defaultdict(float)
        return out

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
                if (
                    self._entered is not None
                    and not self._armed
                    and time.monotonic() - self._entered >= self.dump_on_term_after_s
                ):
                    # chain=True: after the dump the previous (default) action still ends the process.
                    faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)
                    self._armed = True


def maybe_inject(phase: str, step: int, rank: int) -> None:
    spec = os.environ.get("RLRUN_FAULT")
    if not spec or any(
        os.environ.get(count, "0") != "0" for count in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
    ):
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
    if mode == "term":  # the handler runs at once (a signal to this process, from its main thread)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


# ---- deadlines: a bound rlrun sets on a call it cannot interrupt (user reward code, data loading) ------------
#
# The call runs where it would anyway (the main thread: user code may rely on signals, as math checkers that
# use `signal.alarm` do); a timer thread waits beside it. When the bound passes first, the timer hands the error
# the caller described to the process's failure reporter, which prints the run's one FAILED line and ends the
# process (no thread can stop a call stuck in C or on a dead filesystem, so leaving is the only bounded answer).
# Runs register their reporter at start (rlrun.launch.failures); the default prints the error and exits 1.


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
