"""How a failing rank reports: ONE line (rank, roles, phase, step, error), then it leaves with os._exit (see
rlrun.run.skeleton's failure policy); the launcher's environment read, and every rank's same early check."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from rlrun.launch.dist import is_peer_failure
from rlrun.launch.env import DistEnv, read_env
from rlrun.runtime.errors import RlrunError
from rlrun.runtime.log import get_logger, let_rank0_report
from rlrun.runtime.memory import return_freed_memory
from rlrun.runtime.phases import PhaseTracker, bound_exit

T = TypeVar("T")


def launch_environment() -> DistEnv | None:
    """This process's rank and world from the launcher, or None once the reason it is unusable is printed."""
    return_freed_memory()  # before any model exists: large blocks freed from now on go back to the system
    try:
        return read_env()
    except RlrunError as exc:
        # The rank itself is unknown, so every process reports (a traceback would say no more).
        get_logger(0).error_once(f"error: {exc}")
        return None


def leave(rc: int) -> NoReturn:
    """End a trainer process with `rc` once its run has closed what it opened. The atexit handlers run (engines,
    worker pools, wandb), then the process ends without interpreter finalization: process groups that outlive
    destroy_process_group (DeepSpeed keeps references to its groups; their gloo threads still run, seen as
    pt_gloo_runloop/gloo_tcp_loop threads at exit) were otherwise torn down by finalization and static destructors,
    which aborted a rank after a successful run now and then ("terminate called without an active exception",
    SIGABRT; a CI run failed so). Failing ranks already leave with os._exit. Only after DeepSpeed was used: other
    runs exit normally, since finalization is what unlinks vLLM's CPU shared-memory segments (its tensor-parallel
    comm), which os._exit leaves behind in /dev/shm for the next run to collide with. Either way bounded: an exit
    still going after runtime.faults.CLOSE_BOUND_S writes every thread's stack and ends with 1 (a CI run once
    waited on a finished rank until its own timeout, with nothing to say where)."""
    bound_exit()
    if "deepspeed" not in sys.modules:
        sys.exit(rc)
    try:
        atexit._run_exitfuncs()
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def checked_on_every_rank(env: DistEnv, check: Callable[[], T]) -> T | None:
    """`check()` (parse and validate: cheap, identical on every rank), or None once its error is printed.
    Every rank sees the same argv and fails the same way; one message (rank 0's) is enough."""
    try:
        return check()
    except RlrunError as exc:
        get_logger(env.rank).error_once(f"error: {exc}")
        let_rank0_report(env.rank)
        return None


@dataclass
class RankFailure:
    """How this rank reports a failure and leaves: its one line (rank, `roles`, the tracker's phase and step, the
    error), the metrics sink closed, then os._exit at once (never waiting for peers in a collective or in teardown).
    `local_only`: no collective was entered yet, so a bad path or dataset fails every rank alike and rank 0 alone
    says it."""

    log: Any
    rank: int
    roles: str
    phase: PhaseTracker
    dist_timeout: float
    local_only: bool = True
    sink: Any = None  # rank 0's metrics sink, once it exists

    def exit(self, exc: BaseException) -> NoReturn:
        if self.local_only and self.rank != 0 and isinstance(exc, RlrunError):
            # A bad path or dataset fails every rank alike: let rank 0 say it once. Only a rank that fails
            # alone (a file missing on its node) speaks up after the wait.
            let_rank0_report(self.rank)
        report_failure(self.log, self.rank, self.roles, self.phase, exc, self.dist_timeout)
        if self.sink is not None:
            self.sink.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if isinstance(exc, KeyboardInterrupt) else 1)


def report_failure(
    log,
    rank: int,
    roles: str,
    phase: PhaseTracker,
    exc: BaseException,
    dist_timeout: float,
) -> None:
    where = f"phase {phase.phase}" + (f" at step {phase.step + 1}" if phase.step >= 0 else "")
    first_line = (str(exc).strip().splitlines() or [""])[0]
    if is_peer_failure(exc) and any(word in first_line.lower() for word in ("timed out", "timeout", "timing out")):
        log.rank_error(
            f"({roles}) stopping in {where}: a collective timed out after --dist_timeout {dist_timeout:g} s "
            f"({type(exc).__name__}: {first_line[:160]}); another rank never reached it — it is hung "
            "(its stack is dumped below when it is stopped) or slower than --dist_timeout allows"
        )
        return
    if is_peer_failure(exc):
        log.rank_error(
            f"({roles}) stopping in {where}: a collective failed "
            f"({type(exc).__name__}: {first_line[:160]}); "
            "another rank failed first — its failure line names the cause; a rank killed by a signal "
            "(out of memory, preemption) prints none: see the launcher's exit codes"
        )
        return
    log.rank_error(f"FAILED ({roles}) in {where}: {type(exc).__name__}: {exc}")
    if not isinstance(exc, (RlrunError, KeyboardInterrupt)):
        traceback.print_exception(exc, file=sys.stderr)  # an unexpected error: its traceback, from this rank only
