"""The run while it runs (rlrun.reporting.live): throughput and MFU by hand, the health lines, and the Prometheus
endpoint scraped from a real 2-rank run while it trains (prometheus-client's own server and text format)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from helpers import REPO, subprocess_env

from rlrun.reporting.live import HealthWatch, PerfBasis, metric_name, perf_line, perf_numbers


def test_throughput_and_mfu_by_hand() -> None:
    """A 1.5B policy, 4 of 8 devices train it at 500 TFLOP/s each: 64 rows of 300 tokens in a 10 s step whose train
    phase took 4 s. verl's names: tokens per second per device of the job, and the update's model FLOPs (6 N T) over
    the actor's devices' peak."""
    basis = PerfBasis(params=1_500_000_000, devices=8, actor_devices=4, peak_flops=5e14)
    got = perf_numbers(basis, batch_tokens=64 * 300, step_s=10.0, train_s=4.0)
    assert got["perf/total_num_tokens"] == 19200
    assert got["perf/throughput"] == pytest.approx(19200 / 10 / 8)
    assert got["perf/mfu/actor"] == pytest.approx(6 * 1.5e9 * 19200 / (4.0 * 4 * 5e14))  # 0.0216
    cpu = PerfBasis(params=100, devices=2, actor_devices=2, peak_flops=None)
    assert "perf/mfu/actor" not in perf_numbers(cpu, 10.0, 1.0, 0.5)
    assert perf_line(cpu).startswith("MFU: none on CPU")
    assert "500 TFLOP/s per device, measured" in perf_line(basis)


def test_health_lines_start_and_clear_once_each() -> None:
    watch = HealthWatch(slow_factor=3.0, logprob_gap=0.05, max_staleness=2)

    def step(n: int, train_s: float, gap: float = 0.01, stale: float = 1.0) -> list[str]:
        return watch.check({"step": n, "time/train": train_s, "time/step": 99.0,
                            "rollout/engine_vs_actor_logprob_diff": gap, "async/staleness_max": stale})

    assert [step(n, 1.0) for n in (1, 2, 3)] == [[], [], []]
    assert step(4, 3.5) == ["health: step 4: phase train took 3.50 s, over 3x its median 1.00 s (--health_slow_factor)"]
    assert step(5, 4.0) == []  # still slow: said once
    assert step(6, 1.1) == ["health: step 6: phase train is back to its usual pace (1.10 s)"]
    lines = step(7, 1.0, gap=0.2, stale=3.0)
    assert len(lines) == 2 and "log-probs differ from the trainer's by 0.2" in lines[0]
    assert "3 weight versions old was trained on, over --max_staleness 2" in lines[1]
    assert step(8, 1.0, gap=0.2, stale=3.0) == []
    assert watch.counts == {"slow_train": 1, "logprob_gap": 1, "staleness": 1}
    assert HealthWatch(0.0, 1.0).check({"step": 9, "time/train": 1e9}) == []  # --health_slow_factor 0: never


def test_metric_names() -> None:
    assert metric_name("perf/mfu/actor") == "rlrun_perf_mfu_actor"
    assert metric_name("eval/pass@4") == "rlrun_eval_pass_4"


def _scrape(port: int) -> dict[str, float]:
    """{sample with its labels: value} of one GET /metrics (Prometheus text format 0.0.4)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_endpoint_serves_each_step_while_a_two_rank_run_trains(tmp_path: Path) -> None:
    """torchrun, 2 ranks, the demo with --metrics_port 0 (any free port, named in the log) and --health_logprob_gap 0
    (so the health check fires at once). Scraped while it runs: the step's numbers as the metrics file records
    them, both ranks' memory, the warning count, the run's trainer; the gap's warning line printed once. Issue 64:
    metrics reached the JSONL, wandb and TensorBoard only, nothing could be watched while the run ran."""
    save = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "rlrun.ppo",
           "--config", "configs/demo.yaml", "--max_steps", "12", "--save_path", str(save), "--metrics_port", "0",
           "--metrics_host", "127.0.0.1", "--health_logprob_gap", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    output: list[str] = []
    scraped: list[dict[str, float]] = []
    try:
        assert proc.stdout is not None
        port = None
        for line in proc.stdout:
            output.append(line)
            found = re.search(r"metrics: Prometheus text on http://127\.0\.0\.1:(\d+)/metrics", line)
            if found:
                port = int(found.group(1))
                break
        assert port, "".join(output)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                sample = _scrape(port)
            except OSError:
                break  # the run ended and its endpoint with it
            if sample.get("rlrun_step", 0) >= 2:
                scraped.append(sample)
                if len(scraped) >= 2:
                    break
            time.sleep(0.05)
        output += proc.stdout.readlines()
        assert proc.wait(timeout=120) == 0, "".join(output)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(output)
    assert scraped, f"no step scraped while the run ran:\n{text[-3000:]}"
    records = {r["step"]: r for r in map(json.loads, (save / "metrics.jsonl").read_text().splitlines())}
    for sample in scraped:
        record = records[int(sample["rlrun_step"])]
        for key in ("reward", "kl", "response_length", "perf/throughput", "perf/total_num_tokens", "actor/policy_loss"):
            assert sample[metric_name(key)] == pytest.approx(record[key], rel=1e-9), key
        assert sample["rlrun_time_train"] > 0 and sample['rlrun_health_warnings{check="logprob_gap"}'] == 1
        assert sample['rlrun_run_info{trainer="ppo"}'] == 1
        for rank in (0, 1):
            assert sample[f'rlrun_memory_rss_bytes{{rank="{rank}"}}'] > 50 * 2**20
            assert sample[f'rlrun_memory_gpu_allocated_bytes{{rank="{rank}"}}'] == 0  # CPU
    assert "rlrun_perf_mfu_actor" not in scraped[0]  # no MFU on CPU
    assert text.count("health: step 1: the engine's log-probs differ from the trainer's") == 1, text[-3000:]
    assert "MFU: none on CPU" in text
    summary = json.loads((save / "summary.json").read_text())
    assert summary["throughput_per_device"] > 0 and summary["mfu_actor"] is None
