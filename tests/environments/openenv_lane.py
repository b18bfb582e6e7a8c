"""Shared by the OpenEnv tests: where the lane's venv is, and why the tests skip without it.

The lane venv (.venv-openenv, made by scripts/ci/install_openenv_lane.sh) holds openenv 0.10, which cannot share
.venv with verifiers 0.4 (their mcp pins conflict). It runs the environment side (servers, validate_llm) as
subprocesses; rlrun stays in .venv and speaks to them over HTTP.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from helpers import lane_skip

REPO = Path(__file__).resolve().parents[2]
OPENENV_PYTHON = REPO / ".venv-openenv" / "bin" / "python"


needs_openenv = lane_skip(OPENENV_PYTHON, "openenv", "OpenEnv", "install_openenv_lane.sh", "The OpenEnv tests are")


def lane_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update({"PYTHONUNBUFFERED": "1", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"})
    env.update(extra)
    return env


@contextlib.contextmanager
def openenv_server(app: str, cwd: Path, timeout: float = 90.0) -> Iterator[str]:
    """`uvicorn APP` in the OpenEnv lane on a free loopback port (cwd on its path); yields its base URL once GET
    /health answers, and stops it after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(OPENENV_PYTHON), "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning"], cwd=cwd, env=lane_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenEnv server did not start: {proc.communicate(timeout=5)[0][-2000:]}")
            time.sleep(0.3)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
