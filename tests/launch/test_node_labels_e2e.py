"""--ref_node_label with two torchrun agents on this host, each playing one node with its own RLRUN_NODE_LABEL.

Static rendezvous (--node_rank) fixes which agent is node 0, as scripts/runpod does."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers import REPO, free_port, subprocess_env

DEMO = ["--config", "configs/demo.yaml", "--max_steps", "1", "--init_kl_coef", "0.01",
        "--actor_num_gpus_per_node", "2", "--ref_num_gpus_per_node", "1", "--vllm_num_engines", "1"]
LABELS = ("alpha", "beta")


def run_two_nodes(args: list[str], tmp_path, timeout: float = 300) -> tuple[list[int], str]:
    port = free_port()
    procs = []
    for node, label in enumerate(LABELS):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
               "-m", "rlrun.ppo", *args, "--save_path", str(tmp_path)]
        env = subprocess_env(RLRUN_NODE_LABEL=label)
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    return [p.returncode for p in procs], "\n".join(outputs)


def table_rows(output: str) -> dict[int, tuple[str, str]]:
    """rank -> (label, roles) from the 'layout by node label' table rank 0 prints."""
    start = output.index("layout by node label:")
    rows = {}
    for line in output[start:].splitlines()[3:]:
        cells = [c.strip() for c in line.split("|")]
        if len(cells) != 6 or not cells[0].isdigit():
            break
        rows[int(cells[0])] = (cells[2], cells[4])
    return rows


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ref_runs_on_the_labelled_node(tmp_path) -> None:
    # Without labels the blocks are actor 0-1, ref 2, engine 3 (node 1 'beta'). Pinning ref and engine to 'alpha'
    # (node 0) places them first, in block order (ref 0, engine 1), and the actor on the ranks left (2-3).
    codes, output = run_two_nodes(DEMO + ["--ref_node_label", "alpha", "--engine_node_label", "alpha"], tmp_path)
    assert codes == [0, 0], output[-4000:]
    assert table_rows(output) == {0: ("alpha", "ref"), 1: ("alpha", "engine"), 2: ("beta", "actor"),
                                  3: ("beta", "actor")}
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_missing_label_fails_every_rank_before_building(tmp_path) -> None:
    codes, output = run_two_nodes(DEMO + ["--ref_node_label", "gamma"], tmp_path)
    assert codes[0] != 0 and codes[1] != 0, output[-4000:]
    errors = re.findall(r"^\[rlrun [\d:]+ error\] (.*)$", output, re.M)
    assert errors, output[-4000:]
    assert "the ref block of 1 rank asks for nodes labelled 'gamma', but no node carries that label" in errors[0]
    assert "node 0 'alpha', node 1 'beta'" in errors[0]
    assert "in phase startup" in errors[0]  # before any group or model is built
    assert not (tmp_path / "metrics.jsonl").exists()
