"""The VLM demo (configs/vlm_demo.yaml: the tiny Qwen2.5-VL, an image task whose answer only the picture gives) per
layout and generation backend, with the same run on blank pictures as the control; one invocation, runs in turn.

    .venv/bin/python bench/vlm.py               # HF generate: 1 rank, 2 ranks colocated, 1 actor + 1 engine
    .venv/bin/python bench/vlm.py --vllm        # + a vLLM engine (the CPU lane, .venv-vllm)

Reported per run: the reward at step 1, the mean of the last 5 steps, the best, and the median seconds per step
(steps 3..N). The vLLM run needs the lane's stand-in for torchvision (tests/engines/no_torchvision: the CPU lane has
no torchvision build; GPU installs have torchvision).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LANE = REPO / ".venv-vllm" / "bin" / "python"
DISAGG = ["--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1"]


def run(python: Path, nproc: int, args: list[str], out: Path, env: dict[str, str]) -> list[dict]:
    cmd = [str(python), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "rlrun.ppo",
           "--config", "configs/vlm_demo.yaml", *args, "--save_path", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def row(name: str, metrics: list[dict]) -> str:
    rewards = [m["reward"] for m in metrics]
    times = [m["time/step"] for m in metrics[2:] if "time/step" in m]
    step = f"{statistics.median(times):.2f}" if times else "-"
    return (f"| {name} | {rewards[0]:.3f} | {sum(rewards[-5:]) / 5:.3f} | {max(rewards):.3f} | {step} | "
            f"{len(rewards)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", action="store_true", help="also a vLLM engine (the CPU lane venv)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rlrun_vlm_bench_"))
    env = {**os.environ, "RLRUN_CACHE": str(work / "cache"), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "RLRUN_NO_PROGRESS": "1"}
    sys.path.insert(0, str(REPO / "src"))
    from rlrun.vision.demo import write_colour_task  # noqa: PLC0415

    blank = write_colour_task(str(work / "blank"), records=32, blank=True)
    steps = ["--max_steps", str(args.steps)]
    lines = ["| layout, backend, pictures | reward step 1 | last 5 steps | best | s/step | steps |", "|---|---|---|---|---|---|"]
    python = Path(sys.executable)
    for name, nproc, extra in [("1 rank, HF", 1, []), ("2 ranks colocated, HF", 2, []),
                               ("1 actor + 1 engine, HF", 2, DISAGG)]:
        lines.append(row(name + ", seen", run(python, nproc, steps + extra, work / f"{nproc}{len(extra)}s", env)))
        print(lines[-1], flush=True)
        model = next((work / "cache").glob("tiny-vl-v*/model-seed42"))
        lines.append(row(name + ", blank", run(python, nproc, steps + extra + ["--pretrain", str(model), "--prompt_data",
                                                                               blank], work / f"{nproc}{len(extra)}b", env)))
        print(lines[-1], flush=True)
    if args.vllm:
        lane_env = {**env, "PYTHONPATH": str(REPO / "tests" / "engines" / "no_torchvision"),
                    "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        metrics = run(LANE, 2, steps + DISAGG + ["--generation_backend", "vllm", "--dist_timeout", "240"],
                      work / "vllm", lane_env)
        lines.append(row("1 actor + 1 engine, vLLM, seen", metrics))
        diffs = [m["rollout/engine_vs_actor_logprob_diff"] for m in metrics]
        print(lines[-1], f"(engine vs actor log-prob diff {min(diffs):.3f}-{max(diffs):.3f})", flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
