"""The preemption notice (rlrun.run.preemption) in a real process: one notice however often launchers pass it on,
a second request after the window ends the process at once, the marker file the Slurm script requeues on. The
runs that stop on a notice and resume: tests/rl/test_resume.py (torchrun) and tests/scripts/test_slurm_scripts.py
(a real Slurm job, preempted and requeued)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import REPO, subprocess_env

from rlrun.run.preemption import MARKER_ENV, PREEMPTED_EXIT, launcher_stopping, mark_preempted, requeued

CHILD = """
import os, signal, sys, time
from rlrun.run import preemption
notice = preemption.PreemptionNotice(rank=3)
notice.install()
for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGTERM):  # slurmstepd, torchrun and srun passing one notice on
    os.kill(os.getpid(), sig)
print("heard", notice.heard, notice.signal, flush=True)
preemption.REPEAT_WINDOW_S = 0.0  # as if the window had passed
time.sleep(0.01)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
print("still running", flush=True)
"""


def test_repeats_are_one_notice_and_a_later_signal_ends_the_process_at_once() -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.stdout.splitlines() == ["heard True SIGTERM"], proc.stdout + proc.stderr
    assert proc.returncode == 128 + 15, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == "rlrun: rank 3: SIGTERM received: stopping after this step with a checkpoint (preemption)"
    assert lines[1].startswith("rlrun: rank 3: SIGTERM again, 0s after the first notice: leaving now")
    assert len(lines) == 2


def test_requeue_count_and_marker(tmp_path: Path) -> None:
    assert requeued({}) == 0 and requeued({"SLURM_RESTART_COUNT": "2"}) == 2 and requeued({"SLURM_RESTART_COUNT": ""}) == 0
    marker = tmp_path / "m"
    mark_preempted(7, "/ckpt/step_00000007", {MARKER_ENV: str(marker)})
    assert marker.read_text() == "preempted after step 7; checkpoint /ckpt/step_00000007\n"
    mark_preempted(7, None, {})  # no marker asked for: nothing written, no error
    assert PREEMPTED_EXIT == 75  # sysexits' EX_TEMPFAIL; scripts and users may test for it


# A job's last words (rlrun.tinker's rank 0 answers its clients): said before torchrun's stop ends the process,
# and only then (a notice is no stop).
LAST_WORDS = """
import os, time
def last_words():
    time.sleep(0.5)  # held up this long, the process still says them whole
    os.write(2, b"last words\\n")
"""

WORKER = LAST_WORDS + """
import sys, time
from rlrun.run import preemption
notice = preemption.PreemptionNotice(rank=1)
notice.last_words = last_words
notice.install()
print("ready", flush=True)
time.sleep(30)
"""


# The main thread waits in C code that no signal interrupts, with the GIL released: a stand-in for a rank waiting in
# an NCCL collective on a dead peer (which needs a GPU), built from glibc's pthread_cond_wait on a condition nobody
# signals (zeroed storage is glibc's static initializer for both).
STUCK_WORKER = LAST_WORDS + """
import ctypes, sys
from rlrun.run import preemption
notice = preemption.PreemptionNotice(rank=1)
notice.last_words = last_words
notice.install()
libc = ctypes.CDLL(None)
mutex, cond = ctypes.create_string_buffer(64), ctypes.create_string_buffer(64)
libc.pthread_mutex_lock(mutex)
print("ready", flush=True)
libc.pthread_cond_wait(cond, mutex)
"""


def _workers(script: str = WORKER) -> list[subprocess.Popen]:
    """Two processes with one command line and one parent (this one), as torchrun starts a node's workers."""
    env = subprocess_env(TORCHELASTIC_RUN_ID="test", LOCAL_WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return procs


def test_sigterm_is_a_notice_while_the_node_s_workers_live_and_torchrun_stopping_them_once_one_ended() -> None:
    """torchrun's own SIGTERM (a worker of its node ended: it stops the rest) ends a worker at once, as it always did,
    once the job said its last words; the same signal while every worker lives is a preemption notice (no last
    words). Real processes and the real /proc."""
    first, second = _workers()
    first.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    assert first.poll() is None  # heard as a notice: it goes on to its step boundary
    second.kill()
    second.wait(10)
    first.kill()
    said = first.communicate(timeout=10)[1]
    assert "SIGTERM received: stopping after this step" in said and "last words" not in said

    first, second = _workers()
    second.kill()
    second.wait(10)  # reaped, as torchrun reaps a worker before it stops the others
    first.send_signal(signal.SIGTERM)
    assert first.wait(10) == -signal.SIGTERM  # the default action: what torchrun expects of its workers
    assert first.communicate(timeout=10)[1] == "last words\n"  # and no notice line: this was no preemption


def test_torchrun_s_stop_ends_a_worker_whose_main_thread_waits_outside_python() -> None:
    """The handler cannot run while the main thread waits in C (STUCK_WORKER's stand-in for a collective); the
    thread the signal wakes says the job's last words STOP_GRACE_S later, then ends the process, and says so."""
    first, second = _workers(STUCK_WORKER)
    second.kill()
    second.wait(10)
    first.send_signal(signal.SIGTERM)
    assert first.wait(30) == -signal.SIGKILL
    said = first.communicate(timeout=10)[1]
    assert said.index("last words") < said.index("stopped by torchrun while waiting outside Python"), said


def test_launcher_stopping_reads_the_launcher_s_environment() -> None:
    assert not launcher_stopping({})  # outside torchrun a SIGTERM is always a notice
    assert not launcher_stopping({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "1"})  # this process is its own one
    assert launcher_stopping({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "2"})  # its sibling is missing
    assert not launcher_stopping({"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "two"})


HELPER = """
import os, signal, sys, time
from rlrun.engines.vllm.child import _die_with_parent
_die_with_parent(os.getppid())  # as the vLLM child does first
for sig in (signal.SIGTERM, signal.SIGUSR1):  # Slurm's notices reach every process of the step
    os.kill(os.getpid(), sig)
time.sleep(0.2)
print("alive", flush=True)
"""


def test_the_vllm_child_outlives_the_notices_its_rank_acts_on() -> None:
    """Slurm sends a notice to every process of the step; the vLLM child used SIGUSR1 as its parent-death signal and
    killed its whole group on it, so the time-limit notice ended the engine mid-step. It now ignores both notices
    (its rank stops it after the save) and dies with its parent on SIGUSR2."""
    proc = subprocess.run([sys.executable, "-c", HELPER], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "alive\n", proc.stdout + proc.stderr
