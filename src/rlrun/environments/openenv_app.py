"""An OpenEnv server that rlrun starts itself (--openenv_app module:app): `python -m uvicorn module:app` on loopback,
a free port, on the engine rank that uses it, started when its episodes are built and stopped when the process ends
(also when it is killed: the server is told to die with its parent).

The interpreter is --openenv_python (default: this one). openenv 0.10 cannot share a venv with verifiers 0.4 (their
mcp pins conflict), so a server often lives in a venv of its own; rlrun only speaks HTTP and WebSocket to it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from typing import IO

from rlrun.runtime.errors import ConfigError

START_TIMEOUT_S = 120.0  # an app's imports (FastAPI, openenv, its environment) on a busy node
OUTPUT_TAIL = 1500  # characters of a server's output kept for the message when it does not start
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the server's process before exec: SIGKILL when the rank that started it dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class AppServer:
    """A running server: its base URL, process and output (a file: a pipe nobody reads would fill and stall it)."""

    url: str
    process: subprocess.Popen
    output: IO[str]

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


def start_app(
    app: str, python: str | None = None, cwd: str | None = None, env: dict[str, str] | None = None
) -> AppServer:
    """Serve `app` (module:attribute, as uvicorn takes it; `cwd`, default this process's, is on its path) on a free
    loopback port; returns once GET /health answers, or raises one ConfigError with the server's last output."""
    if ":" not in app:
        raise ConfigError(f"--openenv_app {app!r} names no app; write module:attribute (e.g. my_env.server.app:app)")
    interpreter = python or sys.executable
    port = free_port("127.0.0.1")
    argv = [interpreter, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    output = tempfile.TemporaryFile(mode="w+")
    try:
        process = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    except OSError as exc:
        raise ConfigError(f"--openenv_app {app}: {interpreter} does not start ({exc}); see --openenv_python") from None
    server = AppServer(f"http://127.0.0.1:{port}", process, output)
    atexit.register(server.stop)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _healthy(server.url):
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            output.seek(0)
            out = output.read()[-OUTPUT_TAIL:]
            if process.returncode not in (None, -signal.SIGKILL):
                why = f"exited with status {process.returncode}"
            else:
                why = f"did not answer GET /health within {START_TIMEOUT_S:g}s"
            raise ConfigError(
                f"--openenv_app {app} ({interpreter} -m uvicorn) {why} ({' '.join(out.split()).rstrip('.')}); "
                "the module must import where the run starts (its folder on PYTHONPATH) in an interpreter with "
                "openenv and uvicorn (--openenv_python)"
            )
        time.sleep(0.3)
    return server


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False
