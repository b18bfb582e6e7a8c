"""The bound on a run's close: teardown and the process's exit (rlrun.runtime.phases.CLOSE_BOUND_S), in fresh
processes, since faulthandler's watchdog ends the process it runs in."""

from __future__ import annotations

import subprocess
import sys
import time

_PRELUDE = "import time, rlrun.runtime.phases as faults\nfaults.CLOSE_BOUND_S = 1.0\n"


def _run(body: str) -> tuple[int, str, str, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _PRELUDE + body], capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start


def test_a_close_that_hangs_writes_its_stacks_and_exits_1_while_one_that_ends_is_disarmed():
    rc, out, err, took = _run("with faults.bounded_close():\n    time.sleep(30)\n")
    assert rc == 1 and took < 25, (rc, took, err)
    assert "Timeout (0:00:01)!" in err and "line 4 in <module>" in err, err  # where it hung
    rc, out, err, _ = _run("with faults.bounded_close():\n    pass\ntime.sleep(2)\nprint('alive')\n")
    assert (rc, out.strip()) == (0, "alive"), err


def test_leave_bounds_the_exit_of_a_finished_run():
    """An atexit handler that never returns (as a hung engine shutdown would) no longer holds the process."""
    rc, out, err, took = _run("import atexit\nfrom rlrun.launch.failures import leave\n"
                              "atexit.register(lambda: time.sleep(30))\nleave(0)\n")
    assert rc == 1 and took < 25, (rc, took, err)
    assert "Timeout (0:00:01)!" in err and "<lambda>" in err, err
    rc, out, err, _ = _run("from rlrun.launch.failures import leave\nleave(3)\n")
    assert rc == 3, err  # a quick exit keeps its code
