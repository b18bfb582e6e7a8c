"""The preemption notice (rlrun.run.preemption) in a real process: one notice however often launchers pass it on,
a second request after the window ends the process at once, the marker file the Slurm script requeues on. The
runs that stop on a notice and resume: tests/rl/test_resume.py (torchrun) and tests/scripts/test_slurm_scripts.py
(a real Slurm job, preempted and requeued)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import REPO, subprocess_env

from rlrun.run.preemption import MARKER_ENV, PREEMPTED_EXIT, mark_preempted, requeued

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
