"""scripts/slurm/ppo.sh and scripts/slurm/train.sh on a real Slurm cluster (two slurmd "nodes" on
this machine).

Every test submits a script with `sbatch` exactly as a user would (flags after ppo.sh, or
after train.sh's trainer argument, go to that trainer); the training tests train the tiny demo for
3 steps to the end.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from cluster_sim import REPO, SlurmCluster, assert_two_nodes_trained, training_env
from helpers import run_rlrun, untimed

SCRIPT = REPO / "scripts" / "slurm" / "ppo.sh"
TRAIN_SH = REPO / "scripts" / "slurm" / "train.sh"
PPO = [str(SCRIPT)]
TRAIN_SH_PPO = [str(TRAIN_SH), "rlrun.ppo"]
TRAIN = ["--config", "configs/demo.yaml", "--max_steps", "3"]

pytestmark = [pytest.mark.slow]


def submit(slurm: SlurmCluster, tmp_path: Path, sbatch_args: list[str], train_args: list[str],
           timeout: float = 240, script: list[str] = PPO, job_name: str = "rlrun-ppo",
           **env: str) -> tuple[int, str, Path]:
    """sbatch SCRIPT, waiting for the job to end (the script and, for train.sh, its trainer argument); returns (job exit
    code, job log text, per-node log dir). JOB_NAME is the script's #SBATCH --job-name, the %x of
    the job log's name."""
    log_dir = tmp_path / "logs"
    job_env = training_env(slurm.env(), RLRUN_LOG_DIR=str(log_dir), **env)
    rc, job_id, sbatch_out = slurm.sbatch_wait(
        ["--output", str(tmp_path / "%x-%j.out"), "--chdir", str(REPO), "--time", "10", *sbatch_args,
         *script, *train_args], timeout=timeout, env=job_env)
    assert job_id.isdigit(), f"sbatch did not print a job id: {sbatch_out}\n{slurm.logs_tail()}"
    job_log = tmp_path / f"{job_name}-{job_id}.out"
    text = job_log.read_text(errors="replace") if job_log.exists() else f"(no job log; sbatch said: {sbatch_out})"
    return rc, text, log_dir


def metrics_lines(save_path: Path) -> list[dict]:
    path = save_path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(300)
def test_one_node_torchrun_cpu_procs(slurm: SlurmCluster, tmp_path: Path) -> None:
    """No GPUs (--gres=none): RLRUN_PROCS_PER_NODE=2 processes under one torchrun on one node, through
    `train.sh rlrun.ppo` (which names the running job rlrun-ppo); ppo.sh runs the same job, preempted twice, in
    test_a_preempted_job_requeues_and_ends_as_if_uninterrupted."""
    save = tmp_path / "out"
    rc, log, log_dir = submit(slurm, tmp_path, ["--nodes", "1", "--gres", "none"],
                              [*TRAIN, "--save_path", str(save)], script=TRAIN_SH_PPO, job_name="rlrun",
                              RLRUN_PROCS_PER_NODE="2")
    assert rc == 0, log
    assert "(rlrun-ppo): python -m rlrun.ppo on 1 node(s)" in log, log
    assert "2 process(es) per node, world size 2" in log, log
    assert "0: rlrun: node 0/1" in log and "starting torchrun with 2 process(es)" in log, log
    assert "saved the policy" in log and "training finished (exit 0)" in log, log
    assert len(metrics_lines(save)) == 3
    node_log = (log_dir / "node-0.log").read_text()
    assert "saved the policy" in node_log and not node_log.startswith("0: ")  # per-node logs carry no prefix


@pytest.mark.timeout(300)
def test_two_nodes_one_torchrun_per_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    """--gres=gpu:1 on two nodes: GPUS_PER_NODE comes from the job's gres request (1), not from the
    whole node's GPUs; one torchrun per node rendezvouses on the first host. RLRUN_RDZV=static here; the
    default (c10d) runs the same job with a node service: tests/scripts/test_node_service.py."""
    save = tmp_path / "out"
    rc, log, log_dir = submit(slurm, tmp_path, ["--nodes", "2", "--gres", "gpu:1"],
                              [*TRAIN, "--save_path", str(save)], RLRUN_RDZV="static")
    assert rc == 0, log
    assert_two_nodes_trained(log, log_dir, save, slurm.node_names[0], "static")
    # --node_rank = SLURM_NODEID: rank 0, the writer, is on node 0
    assert "saved the policy" in (log_dir / "node-0.log").read_text()


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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("trainer", ["rlrun.grpo", "train", ""])
def test_train_sh_unknown_trainer_fails_at_once(slurm: SlurmCluster, tmp_path: Path, trainer: str) -> None:
    """train.sh's first argument must name a trainer; anything else is one error line listing them,
    before any preflight or srun."""
    rc, log, log_dir = submit(slurm, tmp_path, ["--nodes", "1", "--gres", "none"], TRAIN,
                              script=[str(TRAIN_SH), trainer], job_name="rlrun")
    assert rc == 2, log
    expected = (f"rlrun: error: the first argument names the trainer: rlrun.ppo, rlrun.sft, rlrun.rm, rlrun.dpo or "
                f"rlrun.tinker (or ppo, sft, rm, dpo, tinker), got '{trainer}'")
    assert log.startswith(expected) and len(log.strip().splitlines()) == 1, log
    assert not log_dir.exists()


@pytest.mark.timeout(180)
def test_train_sh_submitted_itself_finds_the_node_service_lib(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Submitted directly, train.sh runs as a spool copy: it finds scripts/lib/node_service.sh next to
    the submitted file (also when submitted by a relative path from elsewhere) and its node service
    runs on every node before training would. The service exits, so the job fails before training."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    log_dir = tmp_path / "logs"
    env = training_env(slurm.env(), RLRUN_LOG_DIR=str(log_dir), RLRUN_PREFLIGHT="0",
                       RLRUN_NODE_SERVICE='echo "no index at $SLURMD_NODENAME" >&2; exit 3')
    relative = os.path.relpath(TRAIN_SH, elsewhere)
    # --chdir elsewhere: neither the job's directory nor the submit directory is an rlrun checkout.
    rc, job_id, out = slurm.sbatch_wait(
        ["--output", str(tmp_path / "%x-%j.out"), "--chdir", str(elsewhere), "--time", "5",
         "--nodes", "2", "--gres", "gpu:1", relative, "dpo", *TRAIN], timeout=150, env=env, cwd=elsewhere)
    assert job_id.isdigit(), out
    log = (tmp_path / f"rlrun-{job_id}.out").read_text(errors="replace")
    assert rc != 0, log
    assert "(rlrun-dpo): python -m rlrun.dpo on 2 node(s)" in log, log
    assert "needs scripts/lib/node_service.sh" not in log, log
    # The first node whose service fails ends the step (--kill-on-bad-exit), maybe before the other reports.
    assert re.search(r"node service on \S+ exited \(code 3\) before it was up", log), log
    assert re.search(r"  \| no index at \S+", log), log
    assert "training FAILED" in log and "starting torchrun with" not in log, log
    assert list(log_dir.glob("node-service-*.log")), "no node service log"


@pytest.mark.timeout(300)
def test_train_sh_sft_two_nodes(slurm: SlurmCluster, tmp_path: Path) -> None:
    """`train.sh sft` (bare trainer name): the preflight runs `python -m rlrun.sft --dry_run` for world
    size 2, then one torchrun per node trains the tiny model with SFT for 2 steps; rank 0 saves it."""
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"input": f"what is {i} + 1?", "output": str(i + 1)}) + "\n" for i in range(16)))
    save = tmp_path / "out"
    rc, log, log_dir = submit(slurm, tmp_path, ["--nodes", "2", "--gres", "gpu:1"],
                              ["--dataset", str(data), "--input_key", "input", "--output_key", "output",
                               "--max_steps", "2", "--train_batch_size", "4", "--micro_train_batch_size", "2",
                               "--save_path", str(save)],
                              script=[str(TRAIN_SH), "sft"], job_name="rlrun")
    assert rc == 0, log
    assert "(rlrun-sft): python -m rlrun.sft on 2 node(s)" in log and "world size 2" in log, log
    assert "python -m rlrun.sft: 2 ranks" in (log_dir / "preflight.log").read_text(), log
    for node in (0, 1):
        assert re.search(rf"^{node}: rlrun: node {node}/2 .*starting torchrun with 1 process", log, re.M), log
    assert "saved the model" in log and "training finished (exit 0)" in log, log
    assert [m["step"] for m in metrics_lines(save)] == [1, 2]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("in_checkout", [True, False], ids=["job-in-checkout", "job-elsewhere"])
def test_copied_ppo_sh_finds_train_sh_or_says_so(slurm: SlurmCluster, tmp_path: Path, in_checkout: bool) -> None:
    """A copy of ppo.sh (own #SBATCH edits) away from train.sh runs the checkout's train.sh when the
    job runs in an rlrun checkout (here: its preflight rejects a bad flag), else fails in one line."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "ppo.sh").write_text(SCRIPT.read_text())
    log_dir = tmp_path / "logs"
    rc, job_id, out = slurm.sbatch_wait(
        ["--output", str(tmp_path / "%x-%j.out"), "--chdir", str(REPO if in_checkout else mine), "--time", "5",
         "--nodes", "1", "--gres", "none", "ppo.sh", *TRAIN, "--no_such_flag", "1"], timeout=150,
        env=training_env(slurm.env(), RLRUN_LOG_DIR=str(log_dir)), cwd=mine)
    assert job_id.isdigit(), out
    log = (tmp_path / f"rlrun-ppo-{job_id}.out").read_text(errors="replace")
    assert rc != 0, log
    if in_checkout:
        assert "(rlrun-ppo): python -m rlrun.ppo on 1 node(s)" in log, log
        assert "unknown flag '--no_such_flag'" in log and "Nothing was started" in log, log
    else:
        assert log.strip() == (f"rlrun: error: ppo.sh runs train.sh, which is not next to {mine / 'ppo.sh'}; copy "
                               "scripts/slurm/train.sh there too, or submit from an rlrun checkout"), log


def _job(slurm: SlurmCluster, job_id: str, env: dict[str, str]) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True,
                           timeout=30)
    return dict(f.split("=", 1) for f in shown.stdout.split() if "=" in f)


def _until(what: str, ready, timeout: float = 120, seen=lambda: "") -> None:
    """Wait for ready(); past the timeout, an error with what `seen()` tells (a job's state and log)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not after {timeout:.0f} s: {what}\n{seen()}")
        time.sleep(0.2)


def _start_requeued(slurm: SlurmCluster, job_id: str, env: dict[str, str], restarts: int) -> None:
    """Wait until the job is pending after its `restarts`-th requeue, then start it now: Slurm holds a requeued job
    for a while (its begin time is set once the old processes are gone, so asking earlier does nothing)."""
    _until(f"requeue {restarts}", lambda: (lambda j: j.get("Restarts") == str(restarts) and j.get("JobState") == "PENDING")(
        _job(slurm, job_id, env)))
    # The requeue revoked the old run's credential on the node, and a credential issued within the same second counts
    # as revoked ("Killing non-startable batch JobId=1: Job credential revoked" in slurmctld's log, and the job is
    # gone): Slurm's own hold on a requeued job is what avoids it, so a start forced now must wait that second out.
    time.sleep(2)
    def running() -> bool:
        if _job(slurm, job_id, env).get("JobState") == "PENDING":
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env, timeout=30)
            time.sleep(1)
            return False
        return True
    _until(f"start {restarts}", running)


@pytest.mark.timeout(420)
def test_a_preempted_job_requeues_and_ends_as_if_uninterrupted(slurm: SlurmCluster, tmp_path: Path) -> None:
    """ppo.sh as submitted (its #SBATCH --requeue, --open-mode=append, --signal=B:TERM@300): no GPUs
    (--gres=none), RLRUN_PROCS_PER_NODE=2 processes under one torchrun on one node, 16 steps, a checkpoint every 8. Issue 64: nothing handled SIGTERM, so a preempted job
    lost everything since its last checkpoint. Preempted twice here, both ways Slurm does it:
    1. the time-limit notice: SIGTERM to the batch shell alone (what --signal=B:TERM sends; scancel --batch here),
       which passes it on to the step as SIGUSR1; the ranks save the step they are in, train.sh requeues the job;
    2. Slurm's own requeue (scontrol requeue, what preemption with PreemptMode=REQUEUE does): SIGTERM to every
       process of the job; the ranks save within KillWait and Slurm requeues the job itself.
    Each requeued start resumes from the newest checkpoint by itself; the job then completes with one metrics line
    per step, equal to an uninterrupted 2-rank run's (outside Slurm), timings aside."""
    save = tmp_path / "out"
    base = [*TRAIN[:2], "--max_steps", "16", "--save_steps", "8"]
    args = [*base, "--save_path", str(save), "--ckpt_path", str(save / "ckpt")]
    log_dir = tmp_path / "logs"
    env = training_env(slurm.env(), RLRUN_LOG_DIR=str(log_dir), RLRUN_PROCS_PER_NODE="2")
    out = subprocess.run(["sbatch", "--parsable", "--output", str(tmp_path / "%x-%j.out"), "--chdir", str(REPO),
                          "--time", "10", "--nodes", "1", "--gres", "none", *PPO, *args], env=env, capture_output=True,
                         text=True, timeout=60)
    job_id = out.stdout.strip().split(";")[0]
    assert job_id.isdigit(), out.stdout + out.stderr
    try:
        steps = lambda: len(metrics_lines(save))  # noqa: E731
        for restarts, notice in ((0, ["scancel", "--signal=TERM", "--batch", job_id]), (1, ["scontrol", "requeue", job_id])):
            if restarts:
                _start_requeued(slurm, job_id, env, restarts)
            before = steps()
            _until("a step of this start", lambda: steps() > before, seen=lambda: _job(slurm, job_id, env).get(
                "JobState", "?") + "\n" + "".join(p.read_text(errors="replace")[-3000:] for p in tmp_path.glob("*.out")))
            subprocess.run(notice, env=env, check=True, timeout=30)
        _start_requeued(slurm, job_id, env, 2)
        _until("the job's end", lambda: _job(slurm, job_id, env).get("JobState") not in (
            "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"), timeout=200)
    finally:
        subprocess.run(["scancel", job_id], env=env, timeout=30)
    log = (tmp_path / f"rlrun-ppo-{job_id}.out").read_text(errors="replace")
    assert _job(slurm, job_id, env)["JobState"] == "COMPLETED", log
    stops = re.findall(r"preempted \((SIGUSR1|SIGTERM)\) after step (\d+): checkpoint (\S+);", log)
    # The batch shell passes its notice on as SIGUSR1. Slurm's requeue signals the batch shell too, which passes it
    # on as well: the ranks hear whichever comes first, and the other as a repeat.
    assert len(stops) == 2 and stops[0][0] == "SIGUSR1" and stops[1][0] in ("SIGTERM", "SIGUSR1"), log
    assert "TERM received: the training processes finish their step" in log, log  # the batch shell passed it on
    assert f"requeueing job {job_id}, which resumes from that checkpoint" in log, log
    for n, (_, step, checkpoint) in enumerate(stops, start=1):
        assert f"Slurm requeued this job ({n} time(s)): resuming from {save / 'ckpt'}" in log, log
        assert f"resumed from {checkpoint} at step {step}" in log, log
    assert "training finished (exit 0)" in log and "saved the policy" in log, log
    assert "(rlrun-ppo): python -m rlrun.ppo on 1 node(s)" in log, log
    assert "2 process(es) per node, world size 2" in log, log
    assert "0: rlrun: node 0/1" in log and "starting torchrun with 2 process(es)" in log, log
    node_log = (log_dir / "node-0.log").read_text()
    assert "saved the policy" in node_log and not node_log.startswith("0: ")  # per-node logs carry no prefix
    assert json.loads((save / "summary.json").read_text())["run"]["outcome"] == "finished"
    reference = run_rlrun(2, [*base, "--ckpt_path", str(tmp_path / "reference" / "ckpt")], tmp_path / "reference")
    assert reference.returncode == 0, reference.output[-3000:]
    assert [m["step"] for m in metrics_lines(save)] == list(range(1, 17))
    assert untimed(metrics_lines(save)) == untimed(reference.metrics)
