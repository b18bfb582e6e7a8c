"""scripts/runpod/launch.sh on two "pods": network namespaces joined by a veth link, each with
its own hostname and a hosts file that resolves <pod id>.runpod.internal like RunPod's DNS."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from cluster_sim import REPO, NetnsHosts, Procs, training_env

SCRIPT = REPO / "scripts" / "runpod" / "launch.sh"
TRAIN = ["--config", "configs/demo.yaml", "--max_steps", "3"]
# Job 3's shape: OpenRLHF-M's vision-language GRPO (the tiny Qwen2.5-VL, image prompts in MathV60K's layout)
TRAIN_VLM = ["--config", "configs/vlm_demo.yaml", "--max_steps", "3"]
POD_IDS = ("headpod", "workerpod")
TOKEN = "pod-token-3f9a"

pytestmark = [pytest.mark.slow]


def pod_env(tmp_path: Path, node: int, **extra: str) -> dict[str, str]:
    settings = dict(NODE_RANK=str(node), NNODES="2", NPROC_PER_NODE="1", HEAD_POD_ID="headpod",
                    RUNPOD_POD_ID=POD_IDS[node], CKPT_DIR=str(tmp_path / f"ckpt-{POD_IDS[node]}"),
                    RLRUN_WAIT_TIMEOUT="180")
    return training_env(**{**settings, **extra})


def start_pod(netns: NetnsHosts, procs: Procs, tmp_path: Path, node: int, args: list[str], **extra: str):
    return procs.start(netns.command(node, ["bash", str(SCRIPT), *args]), pod_env(tmp_path, node, **extra),
                       tmp_path / f"{POD_IDS[node]}.out")


def read(tmp_path: Path, name: str) -> str:
    path = tmp_path / name
    return path.read_text(errors="replace") if path.exists() else ""


def node_log(tmp_path: Path, node: int) -> str:
    return read(tmp_path, f"ckpt-{POD_IDS[node]}/logs/node-{node}.log")


def metrics(tmp_path: Path, node: int) -> list[dict]:
    text = read(tmp_path, f"ckpt-{POD_IDS[node]}/metrics.jsonl")
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.timeout(300)
def test_head_then_worker_static(netns: NetnsHosts, procs: Procs, tmp_path: Path) -> None:
    """Default (static rendezvous): node 0 = rank 0, so the model and metrics land on the head pod."""
    start_pod(netns, procs, tmp_path, 0, TRAIN)
    time.sleep(2)
    start_pod(netns, procs, tmp_path, 1, TRAIN)
    rcs = procs.wait_all(240)
    head, worker = node_log(tmp_path, 0), node_log(tmp_path, 1)
    assert rcs == [0, 0], f"head:\n{head}\nworker:\n{worker}"
    assert "on headpod: head of 2 pod(s)" in head and "on workerpod: worker of 2 pod(s)" in worker
    assert "NCCL_SOCKET_IFNAME=eth0 GLOO_SOCKET_IFNAME=eth0" in head  # the interface that reaches the head
    assert "all 2 pod(s) joined" in head and "all 2 pod(s) joined" in worker
    assert "saved the policy" in head and "saved the policy" not in worker
    assert len(metrics(tmp_path, 0)) == 3
    assert (tmp_path / "ckpt-headpod" / "config.json").exists()
    # The log on disk holds the same lines the pod printed.
    assert "training finished (exit 0)" in read(tmp_path, "headpod.out") and "training finished (exit 0)" in head


@pytest.mark.timeout(300)
def test_worker_first_c10d_with_reward_server(netns: NetnsHosts, procs: Procs, tmp_path: Path) -> None:
    """OpenRLHF-M's job on the launcher, with the VLM demo: the worker starts well before the head and waits for it;
    c10d rendezvous; the head serves the verifier over HTTP with a bearer token and every pod scores its image
    prompts' responses through it."""
    reward = dict(RLRUN_RDZV="c10d", RLRUN_REWARD_SERVER="1", RLRUN_REWARD_TOKEN=TOKEN,
                  RLRUN_REWARD_FILE=str(REPO / "src" / "rlrun" / "rewards" / "demo.py"), RLRUN_REWARD_PORT="5055",
                  RLRUN_CACHE=str(tmp_path / "cache"))  # the tiny VLM and its images, shared by the two "pods"
    start_pod(netns, procs, tmp_path, 1, TRAIN_VLM, **reward)
    # Start the head only once the worker has printed a progress line: a fixed sleep raced with the
    # head's own start-up time (the head could answer at exactly 10 s, before the line was due).
    deadline = time.monotonic() + 60
    waiting = re.compile(r"\(1\ds/180s\)")  # the worker's 10 s progress line (11 s on a busy machine)
    while not waiting.search(node_log(tmp_path, 1)):
        assert time.monotonic() < deadline and procs.procs[0].poll() is None, read(tmp_path, "workerpod.out")
        time.sleep(0.5)
    start_pod(netns, procs, tmp_path, 0, TRAIN_VLM, **reward)
    rcs = procs.wait_all(240)
    head, worker = node_log(tmp_path, 0), node_log(tmp_path, 1)
    assert rcs == [0, 0], f"head:\n{head}\nworker:\n{worker}"
    assert waiting.search(worker) and "head headpod.runpod.internal:29500 answers" in worker, worker
    assert "reward server is up: http://headpod.runpod.internal:5055/reward" in head, head
    # c10d orders nodes by address: headpod.runpod.internal sorts before workerpod.runpod.internal.
    assert "saved the policy" in head and len(metrics(tmp_path, 0)) == 3, head
    assert "generation backend hf (auto: the native engine cannot run this policy ('qwen2_5_vl' is a vision" in head, head
    server_log = read(tmp_path, "ckpt-headpod/logs/reward-server.log")
    assert "bearer token required" in server_log
    for ip in ("10.77.0.1", "10.77.0.2"):  # both pods' ranks scored their rollouts on the server
        assert f"{ip} POST /reward -> 200" in server_log, server_log
    assert "-> 401" not in server_log
    assert TOKEN not in head + worker + server_log + read(tmp_path, "headpod.out")


@pytest.mark.timeout(120)
def test_worker_gives_up_without_a_head(netns: NetnsHosts, procs: Procs, tmp_path: Path) -> None:
    proc = start_pod(netns, procs, tmp_path, 1, TRAIN, RLRUN_WAIT_TIMEOUT="4")
    procs.wait_all(90)
    out = read(tmp_path, "workerpod.out")
    assert proc.returncode == 2, out
    assert "waiting for head headpod.runpod.internal:29500 (0s/4s)" in out
    assert "gave up after 4s (RLRUN_WAIT_TIMEOUT)" in out and "HEAD_POD_ID" in out


@pytest.mark.timeout(60)
def test_usage_errors(tmp_path: Path) -> None:
    import subprocess

    def launch(*args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SCRIPT), *args], env=training_env(**env), capture_output=True,
                              text=True, timeout=30, cwd=tmp_path)

    assert "run this on EVERY pod" in launch("--help").stdout
    result = launch("--config", "x.yaml", NNODES="2")
    assert result.returncode == 2 and "set NODE_RANK" in result.stderr
    result = launch("--worker", NNODES="2", NODE_RANK="0")
    assert result.returncode == 2 and "--worker with NODE_RANK=0" in result.stderr
    result = launch(NNODES="2", NODE_RANK="5")
    assert result.returncode == 2 and "must be 0..1" in result.stderr
    result = launch(NNODES="2", NODE_RANK="1")
    assert result.returncode == 2 and "HEAD_POD_ID" in result.stderr
