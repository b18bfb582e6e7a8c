"""--async_train vs synchronous steps on one disaggregated CPU layout, alternating, in one invocation.

    .venv/bin/python bench/async_train.py                 # 2 rounds x 12 steps
    .venv/bin/python bench/async_train.py --rounds 1 --steps 4

Layouts (--ranks): 2 = actor on rank 0, one HF engine on rank 1 (one core each on a 2-core machine, so the
overlap is not eaten by the cores); 4 = actor on ranks 0-1, two engines on 2-3 (4 processes on 2 cores:
generation and training slow each other down while they overlap). GRPO on the built-in demo task with
longer responses. Per round, the synchronous run and the async run (same everything else) alternate.
Reported per mode: the median s/step over steps 3..N, and the synchronous run's phases, so the async
step can be read against max(generate, train) and their sum.
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
WARMUP = 2
ARGS = ["--config", "configs/demo.yaml", "--generate_max_len", "48", "--rollout_batch_size", "16",
        "--n_samples_per_prompt", "4", "--train_batch_size", "64", "--micro_train_batch_size", "16",
        "--micro_rollout_batch_size", "16"]


def run(mode: str, steps: int, out: Path, ranks: int) -> list[dict]:
    half = str(ranks // 2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m", "rlrun.ppo",
           *ARGS, "--actor_num_gpus_per_node", half, "--vllm_num_engines", half,
           "--max_steps", str(steps), "--save_path", str(out)] + (["--async_train"] if mode == "async" else [])
    env = dict(os.environ, OMP_NUM_THREADS="1", RLRUN_NO_PROGRESS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def med(metrics: list[dict], key: str) -> float:
    return statistics.median(m.get(key, 0.0) for m in metrics[WARMUP:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ranks", type=int, choices=(2, 4), default=2)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in ("sync", "async"):
                m = run(mode, args.steps, Path(tmp) / f"{mode}{r}", args.ranks)
                rows.append({"round": r, "mode": mode, "s_per_step": med(m, "time/step"),
                             "generate": med(m, "time/generate"), "learn": med(m, "time/score") + med(m, "time/train"),
                             "sync": med(m, "time/sync"), "engine_generate": med(m, "time/engine_generate"),
                             "wait_rollout": med(m, "time/wait_rollout"), "reward_last": m[-1]["reward"]})
                print(json.dumps(rows[-1]), flush=True)
    sync = [r for r in rows if r["mode"] == "sync"]
    asyn = [r for r in rows if r["mode"] == "async"]
    s_step, a_step = statistics.median(r["s_per_step"] for r in sync), statistics.median(r["s_per_step"] for r in asyn)
    gen, learn = statistics.median(r["generate"] for r in sync), statistics.median(r["learn"] for r in sync)
    summary = {"sync_s_per_step": s_step, "async_s_per_step": a_step, "speedup": s_step / a_step,
               "sync_generate": gen, "sync_learn": learn, "max_generate_learn": max(gen, learn),
               "sum_generate_learn": gen + learn, "ranks": args.ranks, "rows": rows, "load": os.getloadavg()}
    print(f"sync {s_step:.3f} s/step (generate {gen:.3f} + score/train {learn:.3f}), async {a_step:.3f} s/step: "
          f"{s_step / a_step:.2f}x; max(generate, train) {max(gen, learn):.3f}, sum {gen + learn:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"async_train_{args.ranks}ranks.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
