"""RLRUN_NODE_SERVICE: one service per node (scripts/lib/node_service.sh), started by
scripts/runpod/launch.sh and scripts/slurm/ppo.sh before training, awaited on its health URL, logged
per node, and stopped after training, also when training fails or the launcher is signalled.

The services are real processes with GET /health: `python -m rlrun.reward_server`, and on the two
netns pods `python -m rlrun.retriever_server`, which the pods' ranks search while training (the
Search-R1 agent). The single-pod tests and the Slurm task-per-process test replace the trainer with a
stand-in (FAKE_TORCHRUN, FAKE_PYTHON) that asks the service from the training side and exits: they
test the launchers, not training. The two multi-node happy paths train the tiny model for real.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster_sim import REPO, NetnsHosts, Procs, SlurmCluster, assert_two_nodes_trained, free_port, training_env
from helpers import teach_tiny_model

LAUNCH = REPO / "scripts" / "runpod" / "launch.sh"
PPO_SH = REPO / "scripts" / "slurm" / "ppo.sh"
TRAIN = ["--config", "configs/demo.yaml", "--max_steps", "3"]
HOST = socket.gethostname()

FAKE_TORCHRUN = """#!/usr/bin/env bash
# Stand-in for torchrun: asks the node service's health URL (FAKE_HEALTH), then exits FAKE_RC.
echo "fake-train: started"
if [[ -n "${FAKE_HEALTH:-}" ]]; then
    "$RLRUN_PYTHON" -c 'import sys, urllib.request as u
print("fake-train: service answered", u.urlopen(sys.argv[1], timeout=5).status)' "$FAKE_HEALTH"
fi
[[ -n "${FAKE_SLEEP:-}" ]] && exec sleep "$FAKE_SLEEP"
exit "${FAKE_RC:-0}"
"""

FAKE_PYTHON = """#!/usr/bin/env bash
# Stand-in python for RLRUN_LAUNCH=srun: `-m rlrun.ppo` reports whether this task's node service
# (port FAKE_PORT_BASE + SLURM_NODEID) answers; anything else (the health checks) is the real python.
if [[ "${1:-}" == -m && "${2:-}" == rlrun.ppo ]]; then
    exec "$REAL_PYTHON" -c 'import os, time, urllib.request as u
if os.environ["SLURM_LOCALID"] != "0":
    time.sleep(3)  # local task 0 is long done by now: its service must still be up for this task
url = "http://127.0.0.1:%d/health" % (int(os.environ["FAKE_PORT_BASE"]) + int(os.environ["SLURM_NODEID"]))
status = u.build_opener(u.ProxyHandler({})).open(url, timeout=5).status
print("fake-rank %s local %s on %s: %s answered %d" % (os.environ["SLURM_PROCID"], os.environ["SLURM_LOCALID"],
      os.environ["SLURMD_NODENAME"], url, status), flush=True)'
fi
exec "$REAL_PYTHON" "$@"
"""


def reward_service(port: int | str) -> str:
    """A real service with GET /health: the reward server, on 127.0.0.1 only."""
    return (f"{sys.executable} -m rlrun.reward_server --reward_file src/rlrun/rewards/demo.py "
            f"--host 127.0.0.1 --port {port}")


def pid_alive(pid: int) -> bool:
    """True for a live process (a zombie counts as gone: it no longer runs)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def group_alive(pgid: int) -> bool:
    """True while any live process is in process group pgid."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def port_answers(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def service_pids(service_log: str) -> list[int]:
    return [int(pid) for pid in re.findall(r"node service pid (\d+) on", service_log)]


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


# ---------------------------------------------------------------------------------------------
# scripts/runpod/launch.sh on one pod, torchrun replaced by FAKE_TORCHRUN: cheap, no root needed.

def launch_one_pod(tmp_path: Path, procs: Procs, wait: bool = True, **env: str) -> tuple[subprocess.Popen, str]:
    fake = tmp_path / "fake_torchrun.sh"
    fake.write_text(FAKE_TORCHRUN)
    pod_env = training_env(NNODES="1", CKPT_DIR=str(tmp_path / "ckpt"), RLRUN_TORCHRUN=f"bash {fake}", **env)
    out = tmp_path / "pod.out"
    proc = procs.start(["bash", str(LAUNCH), *TRAIN], pod_env, out)
    if wait:
        procs.wait_all(90)
    return proc, read(out)


def service_log(tmp_path: Path) -> str:
    return read(tmp_path / "ckpt" / "logs" / f"node-service-{HOST}.log")


@pytest.mark.timeout(120)
def test_pod_service_is_up_before_training_and_stopped_after(procs: Procs, tmp_path: Path) -> None:
    port = free_port()
    health = f"http://127.0.0.1:{port}/health"
    proc, out = launch_one_pod(tmp_path, procs, RLRUN_NODE_SERVICE=reward_service(port),
                               RLRUN_NODE_SERVICE_HEALTH=health, FAKE_HEALTH=health)
    assert proc.returncode == 0, out
    assert f"node service is up on {HOST}: {health}" in out, out
    # The service answered the trainer, which was started only after the service was up.
    assert out.index(f"node service is up on {HOST}") < out.index("starting torchrun") < out.index("fake-train: started")
    assert "fake-train: service answered 200" in out, out
    log = service_log(tmp_path)
    assert f"rlrun: node service on {HOST}" in log and f"listening on http://127.0.0.1:{port}" in log, log
    # Stopped with SIGTERM after training (the server says so on a clean shutdown), and gone.
    assert f"stopped the node service on {HOST}" in out and "rlrun reward server: stopped" in log, out + log
    (pid,) = service_pids(log)
    assert not pid_alive(pid) and not port_answers(port)
    assert f"node service is up on {HOST}" in read(tmp_path / "ckpt" / "logs" / "node-0.log")  # the pod's log


@pytest.mark.timeout(120)
def test_pod_service_is_stopped_when_training_fails(procs: Procs, tmp_path: Path) -> None:
    port = free_port()
    proc, out = launch_one_pod(tmp_path, procs, RLRUN_NODE_SERVICE=reward_service(port),
                               RLRUN_NODE_SERVICE_HEALTH=f"http://127.0.0.1:{port}/health", FAKE_RC="7")
    assert proc.returncode == 7, out
    assert "training FAILED (exit 7)" in out and f"stopped the node service on {HOST}" in out, out
    (pid,) = service_pids(service_log(tmp_path))
    assert not pid_alive(pid) and not port_answers(port)


@pytest.mark.timeout(120)
def test_pod_service_is_stopped_when_the_launcher_is_terminated(procs: Procs, tmp_path: Path) -> None:
    port = free_port()
    health = f"http://127.0.0.1:{port}/health"
    proc, _ = launch_one_pod(tmp_path, procs, wait=False, RLRUN_NODE_SERVICE=reward_service(port),
                             RLRUN_NODE_SERVICE_HEALTH=health, FAKE_HEALTH=health, FAKE_SLEEP="120")
    deadline = time.monotonic() + 60
    while "fake-train: service answered 200" not in read(tmp_path / "pod.out"):
        assert time.monotonic() < deadline and proc.poll() is None, read(tmp_path / "pod.out")
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGTERM)  # the launcher only, as a pod shutdown or `kill` would
    proc.wait(30)
    out = read(tmp_path / "pod.out")
    assert proc.returncode == 143, out
    assert f"stopped the node service on {HOST}" in out, out
    (pid,) = service_pids(service_log(tmp_path))
    assert not pid_alive(pid) and not port_answers(port)


@pytest.mark.timeout(120)
def test_pod_service_without_health_url_only_has_to_stay_alive(procs: Procs, tmp_path: Path) -> None:
    proc, out = launch_one_pod(tmp_path, procs, RLRUN_NODE_SERVICE="echo service-ran-on-$(hostname); sleep 60")
    assert proc.returncode == 0, out
    assert re.search(rf"node service is up on {re.escape(HOST)}: pid (\d+) \(alive after 1 s", out), out
    log = service_log(tmp_path)
    assert f"service-ran-on-{HOST}" in log  # the command is run by bash on the node
    (pid,) = service_pids(log)
    assert not group_alive(pid)  # bash and its `sleep 60` child: the whole process group is stopped


@pytest.mark.timeout(60)
def test_pod_service_that_exits_fails_the_pod_before_training(procs: Procs, tmp_path: Path) -> None:
    proc, out = launch_one_pod(tmp_path, procs,
                               RLRUN_NODE_SERVICE='echo "cannot open corpus.jsonl" >&2; exit 3',
                               RLRUN_NODE_SERVICE_HEALTH="http://127.0.0.1:9/health")
    assert proc.returncode == 2, out
    assert f"error: the node service on {HOST} exited (code 3) before it was up; log " in out, out
    assert "  | cannot open corpus.jsonl" in out  # the tail of its log follows the error line
    assert "starting torchrun" not in out and "fake-train" not in out


@pytest.mark.timeout(60)
def test_pod_service_that_never_answers_fails_after_the_wait(procs: Procs, tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    proc, out = launch_one_pod(tmp_path, procs, RLRUN_NODE_SERVICE="sleep 60",
                               RLRUN_NODE_SERVICE_HEALTH=f"http://127.0.0.1:{port}/health", RLRUN_NODE_SERVICE_WAIT="3")
    assert proc.returncode == 2, out
    assert f"error: the node service on {HOST} did not answer http://127.0.0.1:{port}/health within 3s" in out, out
    assert "starting torchrun" not in out and "fake-train" not in out
    (pid,) = service_pids(service_log(tmp_path))
    assert not pid_alive(pid)  # the service that never answered is stopped too


@pytest.mark.timeout(60)
def test_pod_service_whose_health_url_already_answers_is_refused(procs: Procs, tmp_path: Path) -> None:
    """A leftover server on the port would pass for the new service while the new one fails to bind."""
    port = free_port()
    leftover = Procs()
    try:
        server = leftover.start([sys.executable, "-m", "rlrun.reward_server", "--reward_file", "src/rlrun/rewards/demo.py",
                                 "--host", "127.0.0.1", "--port", str(port)], training_env(), tmp_path / "leftover.out")
        deadline = time.monotonic() + 30
        while not port_answers(port):
            assert time.monotonic() < deadline and server.poll() is None, read(tmp_path / "leftover.out")
            time.sleep(0.2)
        proc, out = launch_one_pod(tmp_path, procs, RLRUN_NODE_SERVICE=reward_service(port),
                                   RLRUN_NODE_SERVICE_HEALTH=f"http://127.0.0.1:{port}/health")
    finally:
        leftover.kill_all()
    assert proc.returncode == 2, out
    assert f"error: http://127.0.0.1:{port}/health answers on {HOST} before the node service is started" in out, out
    assert "starting the node service" not in out and "fake-train" not in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("env", "message"), [
    (dict(RLRUN_NODE_SERVICE_HEALTH="http://127.0.0.1:8000/health"), "but RLRUN_NODE_SERVICE (the command) is not"),
    (dict(RLRUN_NODE_SERVICE="sleep 9", RLRUN_NODE_SERVICE_HEALTH="127.0.0.1:8000/health"), "is not an http(s) URL"),
    (dict(RLRUN_NODE_SERVICE="sleep 9", RLRUN_NODE_SERVICE_WAIT="soon"), "RLRUN_NODE_SERVICE_WAIT must be whole seconds"),
])
def test_pod_service_settings_errors(procs: Procs, tmp_path: Path, env: dict[str, str], message: str) -> None:
    proc, out = launch_one_pod(tmp_path, procs, **env)
    assert proc.returncode == 2 and message in out, out
    assert "node service on" not in out and "fake-train" not in out


# ---------------------------------------------------------------------------------------------
# Two netns "pods" (scripts/runpod/launch.sh) and a two-node Slurm cluster (scripts/slurm/ppo.sh).

SEARCH_RECORDS = [
    {"prompt": "Question: who designed the eiffel tower?\n", "question": "who designed the eiffel tower",
     "golden_answers": ["Gustave Eiffel"]},
    {"prompt": "Question: who wrote hamlet?\n", "question": "who wrote hamlet", "golden_answers": ["William Shakespeare"]},
]


def searching_policy(out: Path) -> None:
    """The tiny model, taught to answer each SEARCH_RECORDS prompt with `<search> question </search>`: a random
    tiny model never writes the tag, and the test needs real searches from every pod's ranks."""
    teach_tiny_model(out, [[(r["prompt"], False), (f"<search> {r['question']} </search>", True)] for r in SEARCH_RECORDS])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_pods_each_start_their_own_retriever(netns: NetnsHosts, procs: Procs, tmp_path: Path) -> None:
    """Search-R1's "same retrieval server on every node", without Ray: each pod (own network namespace,
    own loopback) starts `python -m rlrun.retriever_server` through launch.sh, and its ranks train
    with the built-in Search-R1 agent against http://127.0.0.1:PORT/retrieve, i.e. their own pod's
    server. Each server is gone when its pod's launcher exits."""
    port = 5077
    health = f"http://127.0.0.1:{port}/health"
    pods = ("headpod", "workerpod")
    data = tmp_path / "search.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in SEARCH_RECORDS))
    searching_policy(tmp_path / "policy")
    train = ["--config", "configs/search_r1.yaml", "--pretrain", str(tmp_path / "policy"), "--prompt_data", str(data),
             "--retriever_url", f"http://127.0.0.1:{port}/retrieve", "--num_episodes", "2", "--max_steps", "2",
             "--rollout_batch_size", "2", "--n_samples_per_prompt", "2", "--train_batch_size", "4",
             "--micro_rollout_batch_size", "2", "--micro_train_batch_size", "2", "--temperature", "0.3"]
    for node in (0, 1):
        env = training_env(NODE_RANK=str(node), NNODES="2", NPROC_PER_NODE="1", HEAD_POD_ID="headpod",
                           RUNPOD_POD_ID=pods[node], CKPT_DIR=str(tmp_path / f"ckpt-{pods[node]}"),
                           RLRUN_WAIT_TIMEOUT="180", RLRUN_NODE_SERVICE_HEALTH=health,
                           RLRUN_NODE_SERVICE=(f"{sys.executable} -m rlrun.retriever_server --corpus_path "
                                               f"examples/search_r1/corpus.jsonl --host 127.0.0.1 --port {port}"))
        procs.start(netns.command(node, ["bash", str(LAUNCH), *train]), env, tmp_path / f"{pods[node]}.out")
    rcs = procs.wait_all(300)
    outs = [read(tmp_path / f"{pod}.out") for pod in pods]
    assert rcs == [0, 0], f"head:\n{outs[0]}\nworker:\n{outs[1]}"
    for node, pod in enumerate(pods):
        out, log = outs[node], read(tmp_path / f"ckpt-{pod}" / "logs" / f"node-service-{pod}.log")
        assert f"node service is up on {pod}: {health}" in out, out
        assert out.index(f"node service is up on {pod}") < out.index("starting torchrun")
        assert f"rlrun: node service on {pod}" in log and "rlrun retriever server: indexed 30 documents" in log, log
        # This pod's rank searched this pod's server (each namespace has its own 127.0.0.1).
        assert "POST /retrieve -> 200" in log, log
        assert "training finished (exit 0)" in out and f"stopped the node service on {pod}" in out, out
        assert "rlrun retriever server: stopped" in log, log
        (pid,) = service_pids(log)
        assert not pid_alive(pid)
        probe = subprocess.run(netns.command(node, [sys.executable, "-c", (
            f"import socket, sys; s = socket.socket(); s.settimeout(2); sys.exit(s.connect_ex(('127.0.0.1', {port})))")]),
            capture_output=True, timeout=30)
        assert probe.returncode != 0, f"port {port} still answers on {pod}"
    metrics = [json.loads(line) for line in read(tmp_path / "ckpt-headpod" / "metrics.jsonl").splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(m["agent/searches"] > 0 for m in metrics), metrics


def slurm_submit(slurm: SlurmCluster, tmp_path: Path, sbatch_args: list[str], train_args: list[str],
                 **env: str) -> tuple[int, str, Path]:
    """sbatch ppo.sh, waiting for the job to end; (job exit code, job log, per-node log dir)."""
    log_dir = tmp_path / "logs"
    job_env = training_env(slurm.env(), RLRUN_LOG_DIR=str(log_dir), **env)
    rc, job_id, sbatch_out = slurm.sbatch_wait(
        ["--output", str(tmp_path / "%x-%j.out"), "--chdir", str(REPO), "--time", "10", *sbatch_args,
         str(PPO_SH), *train_args], timeout=240, env=job_env)
    assert job_id.isdigit(), f"sbatch did not print a job id: {sbatch_out}\n{slurm.logs_tail()}"
    return rc, read(tmp_path / f"rlrun-ppo-{job_id}.out") or f"(no job log; sbatch said: {sbatch_out})", log_dir


# Both slurmd "nodes" share this machine's loopback: each node's service takes port BASE + SLURM_NODEID
# (the command and the health URL are expanded by bash on the node).
NODE_PORT = "$((%d + SLURM_NODEID))"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_slurm_two_nodes_torchrun_one_service_per_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    """ppo.sh on two nodes with its default rendezvous (c10d) and a node service each: also the plain two-node
    c10d job of test_slurm_scripts.py (the service is a side process this training never calls)."""
    base = free_port()
    save = tmp_path / "out"
    rc, log, log_dir = slurm_submit(
        slurm, tmp_path, ["--nodes", "2", "--gres", "gpu:1"], [*TRAIN, "--save_path", str(save)],
        RLRUN_NODE_SERVICE=reward_service(NODE_PORT % base),
        RLRUN_NODE_SERVICE_HEALTH=f"http://127.0.0.1:{NODE_PORT % base}/health")
    assert rc == 0, log
    assert_two_nodes_trained(log, log_dir, save, slurm.node_names[0], "c10d")
    assert log.count("starting the node service on") == 2, log
    ports = {base, base + 1}
    for name in slurm.node_names:
        up = re.search(rf"^(\d): rlrun: node service is up on {name}: http://127\.0\.0\.1:(\d+)/health$", log, re.M)
        assert up, log
        node, port = int(up.group(1)), int(up.group(2))
        assert port == base + node and port in ports  # the node's own port: expanded on that node
        ports.discard(port)
        # Started before that node's torchrun, stopped after it.
        assert log.index(f"{node}: rlrun: node service is up on {name}") < log.index(f"{node}: rlrun: node {node}/2")
        assert f"{node}: rlrun: stopped the node service on {name}" in log, log
        service_log = read(log_dir / f"node-service-{name}.log")
        assert f"rlrun: node service on {name}" in service_log, service_log
        assert "rlrun reward server: stopped" in service_log
        (pid,) = service_pids(service_log)
        assert not pid_alive(pid) and not port_answers(port)
        assert f"node service is up on {name}" in read(log_dir / f"node-{node}.log")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_slurm_task_per_process_starts_one_service_per_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    """RLRUN_LAUNCH=srun, 2 tasks per node: local task 0 starts the node's service, the other task
    waits for it; all four tasks (stand-in trainers) reach their node's service."""
    base = free_port()
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    rc, log, log_dir = slurm_submit(
        slurm, tmp_path, ["--nodes", "2", "--ntasks-per-node", "2", "--gres", "gpu:2"], TRAIN,
        RLRUN_LAUNCH="srun", RLRUN_PREFLIGHT="0", RLRUN_PYTHON=str(fake), REAL_PYTHON=sys.executable,
        FAKE_PORT_BASE=str(base), RLRUN_NODE_SERVICE=reward_service(NODE_PORT % base),
        RLRUN_NODE_SERVICE_HEALTH=f"http://127.0.0.1:{NODE_PORT % base}/health")
    assert rc == 0, log
    assert "2 process(es) per node, world size 4" in log, log
    assert log.count("starting the node service on") == 2 and log.count("stopped the node service on") == 2, log
    answered = re.findall(r"fake-rank (\d) local (\d) on (\S+): http://127.0.0.1:(\d+)/health answered 200", log)
    assert sorted(rank for rank, *_ in answered) == ["0", "1", "2", "3"], log
    for name in slurm.node_names:
        on_node = [(local, int(port)) for _, local, host, port in answered if host == name]
        assert sorted(local for local, _ in on_node) == ["0", "1"] and len({port for _, port in on_node}) == 1, log
        (pid,) = service_pids(read(log_dir / f"node-service-{name}.log"))
        assert not pid_alive(pid) and not port_answers(on_node[0][1])
    assert not list(log_dir.glob(".node-service-*"))  # the hand-off files are cleaned up


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_slurm_service_that_exits_fails_the_job_before_training(slurm: SlurmCluster, tmp_path: Path) -> None:
    rc, log, log_dir = slurm_submit(slurm, tmp_path, ["--nodes", "2", "--gres", "gpu:1"], TRAIN,
                                    RLRUN_PREFLIGHT="0", RLRUN_NODE_SERVICE='echo "no index at $SLURMD_NODENAME" >&2; exit 3',
                                    RLRUN_NODE_SERVICE_HEALTH="http://127.0.0.1:9/health")
    assert rc != 0, log
    assert "training FAILED" in log and "starting torchrun with" not in log, log
    for name in slurm.node_names:
        if f"node service on {name} exited (code 3) before it was up" in log:
            assert f"  | no index at {name}" in log, log
            break
    else:
        raise AssertionError(f"no node reported its service's exit:\n{log}")


def test_a_failure_report_comes_out_whole_when_srun_terminates_the_task(tmp_path: Path) -> None:
    """srun TERMs every task once another node failed; a TERM that came while a node was reading its service's log
    used to cut that node's report after its first line (a CI run printed no '| no index at' line). A slow `say`
    holds the report open while the whole process group gets the TERM, as srun sends it."""
    (tmp_path / "svc.log").write_text("no index at node-a\nexit 3\n")
    script = tmp_path / "report.sh"
    script.write_text(f"""set -uo pipefail
source {REPO / "scripts" / "lib" / "node_service.sh"}
say() {{ sleep 0.3; echo "rlrun: $*"; }}
trap 'exit 143' TERM
svc_error "the node service exited (code 3) before it was up" {tmp_path / "svc.log"}
echo "not reached"
""")
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 143, out
    assert out.splitlines() == ["rlrun: error: the node service exited (code 3) before it was up",
                                "rlrun:   | no index at node-a", "rlrun:   | exit 3"], out
