"""Shared by the OpenEnv tests: where the lane's venv is, and why the tests skip without it.

The lane venv (.venv-openenv, made by scripts/ci/install_openenv_lane.sh) holds openenv 0.10, which cannot share
.venv with verifiers 0.4 (their mcp pins conflict). It runs the environment side (servers, validate_llm) as
subprocesses; rlrun stays in .venv and speaks to them over HTTP.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from helpers import lane_skip

from rlrun.environments.openenv import start_app

REPO = Path(__file__).resolve().parents[2]
OPENENV_PYTHON = REPO / ".venv-openenv" / "bin" / "python"


needs_openenv = lane_skip(OPENENV_PYTHON, "openenv", "OpenEnv", "install_openenv_lane.sh", "The OpenEnv tests are")


def lane_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env.update({"PYTHONUNBUFFERED": "1", "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"})
    env.update(extra)
    return env


@contextlib.contextmanager
def openenv_server(app: str, cwd: Path) -> Iterator[str]:
    """`uvicorn APP` in the OpenEnv lane on a free loopback port (cwd on its path), started by rlrun's own starter
    (what --openenv_app runs); yields its base URL once GET /health answers, and stops it after."""
    server = start_app(app, str(OPENENV_PYTHON), str(cwd), lane_env())
    try:
        yield server.url
    finally:
        server.stop()
