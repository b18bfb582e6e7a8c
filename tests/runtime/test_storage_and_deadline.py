"""A refused write as one line (rlrun.runtime.errors) and a bound on a call rlrun cannot interrupt
(rlrun.runtime.phases, in a real child process: the bound ends the process)."""

from __future__ import annotations

import errno
import subprocess
import sys
import textwrap
import time

import pytest
from helpers import REPO, subprocess_env

from rlrun.runtime.errors import brief, storage_cause, storage_error


class FakeCheckpointException(BaseException):
    """The shape of torch.distributed.checkpoint's CheckpointException: a BaseException with per-rank failures
    (the real one is raised by DCP inside a collective; tests/rl/test_checkpoint_safety.py meets it for real)."""

    def __init__(self, failures: dict) -> None:
        super().__init__("CheckpointException ranks:dict_keys([0, 1])\nTraceback ... 200 lines")
        self.failures = failures


def test_the_storage_cause_is_found_through_wrappers():
    full = OSError(errno.ENOSPC, "No space left on device", "/ck/.tmp_step_00000003/actor/__1_0.distcp")
    wrapped = FakeCheckpointException({0: (RuntimeError("peer"), None), 1: (full, None)})
    assert storage_cause(wrapped) is full
    try:
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("while saving") from exc
    except RuntimeError as chained:
        assert storage_cause(chained) is full
    assert storage_cause(OSError(errno.ECONNRESET, "reset")) is None  # the network is not the disk
    assert storage_cause(ValueError("x")) is None


def test_one_line_names_path_reason_file_and_space(tmp_path):
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x" / "__0_0.distcp"))
    line = str(storage_error("checkpoint step 3", str(tmp_path / "x"), full, 5 * 2**20, "free space"))
    assert line.startswith(f"cannot write checkpoint step 3 to {tmp_path / 'x'}: No space left on device (errno 28, "
                           f"writing {tmp_path / 'x' / '__0_0.distcp'}); it needs about 5.0 MB, ")
    assert " MB free there; free space" in line and "\n" not in line
    readonly = OSError(errno.EROFS, "Read-only file system")
    assert "needs about" not in str(storage_error("the model", "/ro", readonly, 10, "choose another --save_path"))


def test_brief_keeps_the_ranks_errors_not_their_tracebacks():
    exc = FakeCheckpointException({0: (FileNotFoundError("no .metadata"), None), 1: (FileNotFoundError("no .metadata"), None)})
    assert brief(exc) == "rank 0,1: FileNotFoundError: no .metadata"


def _child(code: str, timeout: float = 60) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def test_a_passed_deadline_reports_once_and_ends_the_process():
    rc, out, seconds = _child("""
        import time
        from rlrun.runtime.phases import deadline, set_reporter
        from rlrun.runtime.errors import RewardError

        def report(exc):
            print(f"FAILED: {type(exc).__name__}: {exc}", flush=True)
            import os; os._exit(3)

        set_reporter(report)
        with deadline(5.0, lambda: RewardError("never")):
            pass  # finished in time: nothing happens
        with deadline(0.5, lambda: RewardError("reward_func took too long")):
            time.sleep(60)  # a hung call in the main thread
        print("not reached")
    """)
    assert rc == 3, out
    assert out.strip() == "FAILED: RewardError: reward_func took too long"
    assert seconds < 30


@pytest.mark.parametrize("uses_alarm", [True, False])
def test_a_hung_reward_function_is_named_within_its_bound(tmp_path, uses_alarm):
    """A reward file that hangs (or uses signal.alarm itself, as math checkers do, and finishes) under the bound."""
    reward = tmp_path / "reward.py"
    reward.write_text(textwrap.dedent(f"""
        import signal, time
        def reward_func(queries, prompts, labels):
            if {uses_alarm}:
                signal.signal(signal.SIGALRM, lambda *a: None)
                signal.alarm(30)  # works: the call runs in the main thread
                signal.alarm(0)
                return [1.0] * len(queries)
            time.sleep(60)
    """))
    rc, out, seconds = _child(f"""
        from rlrun.rewards.reward_fn import load_reward_function
        fn = load_reward_function({str(reward)!r}, call_timeout_s=1.0)
        print(fn(["Q: 1+1 A: 2"], ["Q: 1+1 A:"], ["2"]).rewards.tolist())
    """)
    if uses_alarm:
        assert rc == 0 and out.strip().endswith("[1.0]"), out
    else:
        assert rc == 1, out
        assert (f"RewardError: reward function {reward} did not return within --reward_timeout 1 s on a batch of 1 "
                "queries (the first ends 'Q: 1+1 A: 2')") in out
        assert "Traceback" not in out and seconds < 30
