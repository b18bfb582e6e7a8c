"""Helpers shared by the multi-process tests (a module name no other test folder uses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "RLRUN_NO_PROGRESS": "1",
                "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


@dataclass
class RunResult:
    returncode: int
    output: str
    metrics: list[dict]


def run_rlrun(nproc: int, args: list[str], save_path: Path, timeout: float = 240, env: dict | None = None) -> RunResult:
    """`torchrun --standalone --nproc_per_node N -m rlrun.ppo ARGS` (or plain python for N=0)."""
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "rlrun.ppo"]
    else:
        cmd = [sys.executable, "-m", "rlrun.ppo"]
    cmd += args + ["--save_path", str(save_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=env or subprocess_env(), capture_output=True, text=True, timeout=timeout)
    metrics_file = save_path / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    return RunResult(proc.returncode, proc.stdout + proc.stderr, metrics)
