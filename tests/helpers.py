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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a test's own rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_file_as_ranks(path: str, world: int, outdir: Path, timeout: float) -> None:
    """Start `python PATH RANK WORLD PORT OUTDIR` for every rank of a fresh gloo world on a free port, wait for
    all of them (at most `timeout` seconds in total) and fail with the tail of each one's output if any did not
    exit cleanly. The file's `__main__` block is the per-rank worker; it writes its results under OUTDIR."""
    import time

    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = [subprocess.Popen([sys.executable, path, str(r), str(world), str(port), str(outdir)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    deadline = time.monotonic() + timeout
    try:
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
