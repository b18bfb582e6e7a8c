"""The suite's launcher (tests/forked_world.py): forked ranks see what torchrun gives them, a failing rank ends its
world as torchrun's agent ends it, a timeout leaves no rank behind, and an environment it cannot serve is refused."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

import forked_world
from helpers import REPO, forked_server, free_port, subprocess_env

RANK_SCRIPT = """
import json, os, sys, time
rank = int(os.environ["RANK"])
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT", "TORCHINDUCTOR_CACHE_DIR"]
print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "cwd": os.getcwd(), "main": __name__,
                  **{k: os.environ.get(k) for k in keys}}))
print(f"err of {rank}", file=sys.stderr)
mode = sys.argv[1]
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode in ("fail", "hang") and rank != 1 or mode == "hang":
    time.sleep(600)
"""


@pytest.fixture
def served(tmp_path: Path):
    env = subprocess_env()
    server = forked_server(env)
    if server is None:
        pytest.skip("RLRUN_TEST_LAUNCHER=torchrun: the suite runs without the forked server")
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    return server, script, env


def _run(served, tmp_path: Path, mode: str, timeout: float = 60):
    server, script, env = served
    outs = [tmp_path / f"out{r}" for r in range(2)]
    errs = [tmp_path / f"err{r}" for r in range(2)]
    env = {**env, "RLRUN_X": "1"}
    result = server.run(("path", str(script)), [[mode, str(r)] for r in range(2)], env, REPO, outs, errs,
                        free_port(), timeout)
    return result, outs, errs


def test_ranks_see_torchruns_environment_and_their_own_streams(served, tmp_path) -> None:
    (rc, codes), outs, errs = _run(served, tmp_path, "ok")
    assert (rc, codes) == (0, [0, 0])
    seen = [json.loads(p.read_text()) for p in outs]
    assert [s["RANK"] for s in seen] == ["0", "1"] and [s["argv"] for s in seen] == [["ok", "0"], ["ok", "1"]]
    assert all(s["WORLD_SIZE"] == "2" == s["LOCAL_WORLD_SIZE"] and s["TORCHELASTIC_RESTART_COUNT"] == "0" for s in seen)
    assert seen[0]["TORCHELASTIC_RUN_ID"] == seen[1]["TORCHELASTIC_RUN_ID"] and seen[0]["MASTER_PORT"]
    assert all(s["main"] == "__main__" and s["cwd"] == str(REPO) for s in seen)
    assert seen[0]["pid"] != seen[1]["pid"] != os.getpid()
    # What torch's import sets in a fresh process is there too.
    assert seen[0]["TORCHINDUCTOR_CACHE_DIR"]
    assert [p.read_text() for p in errs] == ["err of 0\n", "err of 1\n"]


def test_a_failing_rank_fails_the_world_and_the_others_are_stopped(served, tmp_path) -> None:
    start = time.monotonic()
    (rc, codes), _, _ = _run(served, tmp_path, "fail")
    assert rc == 1 and codes[1] == 3 and codes[0] == -15  # SIGTERMed, as torchrun's agent does
    assert time.monotonic() - start < 30


def test_a_timeout_kills_every_rank(served, tmp_path) -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        _run(served, tmp_path, "hang", timeout=3)
    pids = [json.loads(p.read_text())["pid"] for p in (tmp_path / "out0", tmp_path / "out1")]
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) for pid in pids):
        assert time.monotonic() < deadline, "a rank outlived its world's timeout"
        time.sleep(0.1)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][:1]
    except (FileNotFoundError, IndexError):
        return "Z"


def test_import_time_variables_must_match_and_run_time_ones_may_differ() -> None:
    server_env = {"HF_HUB_CACHE": "/a", "PATH": "/bin"}
    set_by_imports = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/ti"}
    same = forked_world.import_time_differences
    assert same({**server_env, "RLRUN_FAULT": "x", "PYTEST_CURRENT_TEST": "t"}, server_env, set_by_imports) == []
    assert same({**server_env, "TORCHINDUCTOR_CACHE_DIR": "/tmp/ti"}, server_env, set_by_imports) == []
    assert same({**server_env, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}, server_env, set_by_imports) == [
        "TORCHINDUCTOR_CACHE_DIR"]
    assert same({"PATH": "/bin", "HF_HUB_CACHE": "/b"}, server_env, set_by_imports) == ["HF_HUB_CACHE"]
    assert same({"PATH": "/bin"}, server_env, set_by_imports) == ["HF_HUB_CACHE"]
