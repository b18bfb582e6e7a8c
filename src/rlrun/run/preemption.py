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

torchrun also sends SIGTERM for a reason of its own: a worker of its node ended (failed, or was killed), and it
stops the others before it restarts them or gives up. That SIGTERM must end a worker at once, as it always did: a
rank that went on to its step boundary would meet its dead peer in a collective and print a second failure. A
handler is not told who sent a signal, so a worker tells them apart by what it can see: a first SIGTERM while one
of its node's workers (its parent's children with its own command line) is already gone is torchrun stopping it.
Python runs a handler only between bytecodes of the main thread, which a rank waiting in a collective on its dead
peer may not reach for a long time; so a thread woken by the signal itself (signal.set_wakeup_fd) ends such a rank
STOP_GRACE_S later if its main thread has not.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType

NOTICE_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
# A repeat of the notice closer than this comes from a launcher passing it on, not from a second request.
REPEAT_WINDOW_S = 10.0
# The exit status of a run that saved and stopped on a preemption notice (sysexits' EX_TEMPFAIL: try again later).
PREEMPTED_EXIT = 75
# Where rank 0 writes a line when it stopped on a notice (set by scripts/slurm/train.sh, which then requeues the
# job): a file, because torchrun reports its own exit status, not its workers'.
MARKER_ENV = "RLRUN_PREEMPTED_FILE"
# How long the watching thread leaves torchrun's stop to the main thread's handler (which ends the process with
# SIGTERM's own status, as torchrun reports it) before it ends the process with SIGKILL.
STOP_GRACE_S = 2.0
# The most a job's last words (PreemptionNotice.last_words) may hold torchrun's stop up: well inside the 30 s torchrun
# waits after its SIGTERM before it sends SIGKILL.
LAST_WORDS_S = 20.0


class PreemptionNotice:
    """This process's record of the notice: which signal, and when it first came (monotonic seconds)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.signal: str | None = None
        self.at: float | None = None
        # What a job must still say when torchrun stops this process because another worker ended (rlrun.tinker's
        # rank 0 fails its clients' pending requests and waits until they fetched that): bounded by the job, and
        # said once, by whichever of the main thread's handler and the watching thread comes first.
        self.last_words: Callable[[], None] | None = None
        self._words_lock = threading.Lock()
        self._words_started = False
        self._words_said = threading.Event()

    def install(self) -> None:
        """Take the notice signals from now on (main thread only, as Python's signal module requires); under
        torchrun also watch for its stop beside the main thread (the module docstring says why)."""
        for sig in NOTICE_SIGNALS:
            signal.signal(sig, self._on_signal)
        if "TORCHELASTIC_RUN_ID" in os.environ:
            self._watch_wakeups()

    def _watch_wakeups(self) -> None:
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        if previous != -1:
            # Someone else (an asyncio loop's signal handling) owns the wake-up fd: give it back; the main
            # thread's handler still tells torchrun's stop from a notice, only later.
            signal.set_wakeup_fd(previous)
            os.close(read_end)
            os.close(write_end)
            return
        threading.Thread(target=self._stop_if_launcher, args=(read_end,), name="rlrun-notice", daemon=True).start()

    def _stop_if_launcher(self, read_end: int) -> None:
        """Read the numbers of the signals Python's C-level handler received; on a first SIGTERM that is torchrun
        stopping this worker, give the main thread STOP_GRACE_S to act on it, then end the process."""
        while True:
            signums = os.read(read_end, 64)
            if signal.SIGTERM in signums and self.at is None and launcher_stopping():
                time.sleep(STOP_GRACE_S)
                self._say_last_words()
                _say(f"rank {self.rank}: stopped by torchrun while waiting outside Python (another worker ended)")
                os.kill(os.getpid(), signal.SIGKILL)

    def _say_last_words(self) -> None:
        """The job's last words, once; a second caller waits until they are said (LAST_WORDS_S at most)."""
        with self._words_lock:
            first, self._words_started = not self._words_started, True
        if not first:
            self._words_said.wait(LAST_WORDS_S)
            return
        try:
            if self.last_words is not None:
                self.last_words()
        except Exception as exc:  # noqa: BLE001 - the process ends either way; say why the words were cut
            _say(f"rank {self.rank}: {type(exc).__name__} while answering before the stop: {exc}")
        finally:
            self._words_said.set()

    @property
    def heard(self) -> bool:
        return self.signal is not None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.at is None and signum == signal.SIGTERM and launcher_stopping():
            # torchrun stopping this worker after another one of its node ended: the default action, as before
            self._say_last_words()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.at is None:
            self.signal, self.at = name, now
            _say(f"rank {self.rank}: {name} received: stopping after this step with a checkpoint (preemption)")
        elif now - self.at > REPEAT_WINDOW_S:
            _say(
                f"rank {self.rank}: {name} again, {now - self.at:.0f}s after the first notice: leaving now; the "
                "newest sealed checkpoint is intact"
            )
            os._exit(128 + signum)


def launcher_stopping(environ: Mapping[str, str] | None = None, proc: Path = Path("/proc")) -> bool:
    """Under torchrun: whether fewer of this node's workers are alive than it started (LOCAL_WORLD_SIZE), so that
    a SIGTERM now is torchrun stopping the rest. False outside torchrun, and where /proc cannot tell."""
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in env or not env.get("LOCAL_WORLD_SIZE", "").isdigit():
        return False
    try:
        me = (proc / "self" / "cmdline").read_bytes()
    except OSError:
        return False
    return _live_children(proc, os.getppid(), me) < int(env["LOCAL_WORLD_SIZE"])


def _live_children(proc: Path, parent: int, cmdline: bytes) -> int:
    """Processes of `parent` running `cmdline` that have not ended (a zombie has ended: its parent has not yet
    reaped it)."""
    count = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
            state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
            if int(ppid) == parent and state != "Z" and (entry / "cmdline").read_bytes() == cmdline:
                count += 1
        except (OSError, ValueError):
            continue  # it ended while we looked
    return count


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
