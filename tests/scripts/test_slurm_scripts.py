"""scripts/slurm/ppo.sh on a real Slurm cluster (two slurmd "nodes" on this machine).

Every test submits the script with `sbatch --wait` exactly as a user would (flags after the
script go to rlrun.ppo) and trains the tiny demo for 3 steps to the end.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cluster_sim import REPO, SlurmCluster, training_env

SCRIPT = REPO / "scripts" / "slurm" / "ppo.sh"
TRAIN = ["--config", "configs/demo.yaml", "--max_steps", "3"]

pytestmark = [pytest.mark.slow]


def submit(slurm: SlurmCluster, tmp_path: Path, sbatch_args: list[str], train_args: list[str],
           timeout: float = 240, **env: str) -> tuple[int, str, Path]:
    """sbatch --wait the script; returns (job exit code, job log text, per-node log dir)."""
    log_dir = tmp_path / "logs"
    job_env = training_env(slurm.env(), RLRUN_LOG_DIR=str(log_dir), **env)
    rc, job_id, sbatch_out = slurm.sbatch_wait(
        ["--output", str(tmp_path / "%x-%j.out"), "--chdir", str(REPO), "--time", "10", *sbatch_args,
         str(SCRIPT), *train_args], timeout=timeout, env=job_env)
    assert job_id.isdigit(), f"sbatch did not print a job id: {sbatch_out}\n{slurm.logs_tail()}"
    job_log = tmp_path / f"rlrun-ppo-{job_id}.out"
    text = job_log.read_text(errors="replace") if job_log.exists() else f"(no job log; sbatch said: {sbatch_out})"
    return rc, text, log_dir


def metrics_lines(save_path: Path) -> list[dict]:
    path = save_path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(300)
def test_one_node_torchrun_cpu_procs(slurm: SlurmCluster, tmp_path: Path) -> None:
    """No GPUs (--gres=none): RLRUN_PROCS_PER_NODE=2 processes under one torchrun on one node."""
    save = tmp_path / "out"
    rc, log, log_dir = submit(slurm, tmp_path, ["--nodes", "1", "--gres", "none"],
                              [*TRAIN, "--save_path", str(save)], RLRUN_PROCS_PER_NODE="2")
    assert rc == 0, log
    assert "1 node(s)" in log and "2 process(es) per node, world size 2" in log, log
    assert "0: rlrun: node 0/1" in log and "starting torchrun with 2 process(es)" in log, log
    assert "saved the policy" in log and "training finished (exit 0)" in log, log
    assert len(metrics_lines(save)) == 3
    node_log = (log_dir / "node-0.log").read_text()
    assert "saved the policy" in node_log and not node_log.startswith("0: ")  # per-node logs carry no prefix


@pytest.mark.timeout(300)
@pytest.mark.parametrize("rdzv", ["c10d", "static"])
def test_two_nodes_one_torchrun_per_node(slurm: SlurmCluster, tmp_path: Path, rdzv: str) -> None:
    """--gres=gpu:1 on two nodes: GPUS_PER_NODE comes from the job's gres request (1), not from the
    whole node's GPUs; one torchrun per node rendezvouses on the first host."""
    save = tmp_path / "out"
    rc, log, log_dir = submit(slurm, tmp_path, ["--nodes", "2", "--gres", "gpu:1"],
                              [*TRAIN, "--save_path", str(save)], RLRUN_RDZV=rdzv)
    assert rc == 0, log
    head = slurm.node_names[0]
    assert "2 node(s)" in log and "1 process(es) per node, world size 2" in log, log
    assert f"head={head}:" in log and f"rdzv {rdzv}" in log, log
    for node in (0, 1):
        assert re.search(rf"^{node}: rlrun: node {node}/2 .*starting torchrun with 1 process", log, re.M), log
        assert (log_dir / f"node-{node}.log").exists()
    assert "saved the policy" in log and "training finished (exit 0)" in log, log
    assert len(metrics_lines(save)) == 3
    node_logs = [(log_dir / f"node-{n}.log").read_text() for n in (0, 1)]
    if rdzv == "static":  # --node_rank = SLURM_NODEID: rank 0, the writer, is on node 0
        assert "saved the policy" in node_logs[0]
    assert sum("saved the policy" in text for text in node_logs) == 1


@pytest.mark.timeout(300)
def test_two_nodes_one_srun_task_per_process(slurm: SlurmCluster, tmp_path: Path) -> None:
    """RLRUN_LAUNCH=srun: no torchrun; rlrun reads SLURM_PROCID/SLURM_STEP_* and MASTER_ADDR/PORT."""
    save = tmp_path / "out"
    rc, log, log_dir = submit(slurm, tmp_path, ["--nodes", "2", "--gres", "gpu:1"],
                              [*TRAIN, "--save_path", str(save)], RLRUN_LAUNCH="srun")
    assert rc == 0, log
    assert "launch=srun" in log and "starting 2 task(s) with srun" in log, log
    assert "torchrun" not in log.split("starting 2 task(s) with srun", 1)[1], log
    assert "saved the policy" in log and len(metrics_lines(save)) == 3, log
    assert "saved the policy" in (log_dir / "node-0.log").read_text()  # SLURM_PROCID 0 is on node 0


@pytest.mark.timeout(180)
def test_bad_flags_fail_before_any_node_starts(slurm: SlurmCluster, tmp_path: Path) -> None:
    rc, log, log_dir = submit(slurm, tmp_path, ["--nodes", "2", "--gres", "gpu:1"],
                              [*TRAIN, "--no_such_flag", "1"])
    assert rc != 0
    assert "unknown flag '--no_such_flag'" in log and "Nothing was started" in log, log
    assert not (log_dir / "node-0.log").exists() and "starting one torchrun" not in log


CRASH_ONCE = '''
import os
# Kill the first worker of node group rank 1 on the first attempt, before it reaches any collective.
if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and os.environ.get("GROUP_RANK") == "1" \\
        and os.environ.get("LOCAL_RANK") == "0":
    print("crash-injector: worker of group rank 1 exits on attempt 0", flush=True)
    os._exit(13)
'''


@pytest.mark.timeout(300)
def test_restart_after_a_worker_dies_on_one_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    """A worker on node 1 dies at start: both torchruns restart together and training completes."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(CRASH_ONCE)
    save = tmp_path / "out"
    rc, log, _ = submit(slurm, tmp_path, ["--nodes", "2", "--gres", "gpu:1"],
                        [*TRAIN, "--save_path", str(save), "--dist_timeout", "20"],
                        PYTHONPATH=str(inject), RLRUN_MAX_RESTARTS="1")
    assert "crash-injector" in log, log
    assert rc == 0, log
    assert "saved the policy" in log and len(metrics_lines(save)) == 3
