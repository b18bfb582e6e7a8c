"""Preemption: a signal asks the run to stop at the next step boundary, saved, and to be started again.

Slurm sends SIGTERM before it kills a preempted job (and, with `--signal=[B:]SIG@SECONDS`, the signal asked for
before the time limit: SIGUSR1 by habit). rlrun takes SIGTERM and SIGUSR1 as that notice on every rank: the step in
progress finishes (its phases keep their own bounds), the ranks agree at the step boundary that one of them was
told (a rank may hear it a little later than another), every rank saves the checkpoint of that step (a batch in
flight included: rlrun.rl.async_loop), rank 0 writes the summary and says how to resume, and the process exits with
PREEMPTED_EXIT. scripts/slurm/train.sh requeues the job on that notice and a requeued job resumes from the newest
checkpoint by itself (`requeued`).

Launchers pass one notice on more than once: slurmstepd signals every process of the step, torchrun forwards what it
receives to its workers, srun forwards to its tasks. So a repeat within REPEAT_WINDOW_S is the same notice; a signal
after that is someone insisting, and the process leaves at once (exit 128 + signal). Nothing is lost either way: a
checkpoint is written into a temporary directory and sealed by a rename (rlrun.checkpoint.store), so a process that
ends mid-save leaves the previous checkpoint as the newest.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from types import FrameType

NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# A repeat of the notice closer than this comes from a launcher passing it on, not from a second request.
REPEAT_WINDOW_S = 10.0
# The exit status of a run that saved and stopped on a preemption notice (sysexits' EX_TEMPFAIL: try again later).
PREEMPTED_EXIT = 75
# Where rank 0 writes a line when it stopped on a notice (set by scripts/slurm/train.sh, which then requeues the
# job): a file, because torchrun reports its own exit status, not its workers'.
MARKER_ENV = "RLRUN_PREEMPTED_FILE"


class PreemptionNotice:
    """This process's record of the notice: which signal, and when it first came (monotonic seconds)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.signal: str | None = None
        self.at: float | None = None

    def install(self) -> None:
        """Take the notice signals from now on (main thread only, as Python's signal module requires)."""
        for sig in NOTICE_SIGNALS:
            signal.signal(sig, self._on_signal)

    @property
    def heard(self) -> bool:
        return self.signal is not None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.at is None:
            self.signal, self.at = name, now
            _say(f"rank {self.rank}: {name} received: stopping after this step with a checkpoint (preemption)")
        elif now - self.at > REPEAT_WINDOW_S:
            _say(
                f"rank {self.rank}: {name} again, {now - self.at:.0f}s after the first notice: leaving now; the "
                "newest sealed checkpoint is intact"
            )
            os._exit(128 + signum)


def _say(line: str) -> None:
    """One line on stderr from a signal handler (os.write: no lock the interrupted code may hold)."""
    os.write(2, f"rlrun: {line}\n".encode())


def requeued(environ: Mapping[str, str] | None = None) -> int:
    """How many times Slurm requeued this job (SLURM_RESTART_COUNT; 0 outside Slurm or on a first start)."""
    env = os.environ if environ is None else environ
    count = env.get("SLURM_RESTART_COUNT", "0")
    return int(count) if count.isdigit() else 0


def mark_preempted(step: int, checkpoint: str | None, environ: Mapping[str, str] | None = None) -> None:
    """Rank 0: tell the launching script that the run stopped on a notice (MARKER_ENV's file, when it is set)."""
    env = os.environ if environ is None else environ
    path = env.get(MARKER_ENV)
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(f"preempted after step {step}; checkpoint {checkpoint or 'none'}\n")
