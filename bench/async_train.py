"""Synchronous steps vs --async_train (one step off) vs --partial_rollout on one disaggregated CPU layout, on a
long-tailed workload, alternating, in one invocation; and the padded training tokens with and without
--dynamic_batch.

    .venv/bin/python bench/async_train.py                 # 3 rounds x 20 steps, then 40 learning steps per mode
    .venv/bin/python bench/async_train.py --ranks 4 --rounds 1 --steps 8

The workload: GRPO on the built-in demo task, 16 prompts x 4 samples of up to 96 tokens per step, from a tiny
model that rlrun.sft first teaches long-tailed lengths (save_model): most responses end within 30 tokens, about
a few run to the cap, as reasoning rollouts do. Layouts (--ranks): 2 = actor on rank 0, one
native engine on rank 1 (one core each); 4 = actor on ranks 0-1, engines on 2-3 (4 processes on 2 cores).

Reported per mode: median seconds per step and trained (response) tokens per second over steps 3..N, the
median of the rounds, each as a ratio to the synchronous loop; the reward curve of every run (plot with
--plot); the staleness of --partial_rollout's samples; and the fraction of padded tokens in the training
forwards of the synchronous loop with and without --dynamic_batch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WARMUP = 2
ROLLOUTS = 64
ARGS = ["--config", "configs/demo.yaml", "--remote_rm_url", "demo", "--generate_max_len", "96",
        "--rollout_batch_size", "16", "--n_samples_per_prompt", "4", "--train_batch_size", "64",
        "--micro_train_batch_size", "16", "--micro_rollout_batch_size", "16"]
LEARNING_RATE = "1e-3"
MODES = {
    "sync": [],
    "async": ["--async_train"],
    "partial": ["--async_train", "--partial_rollout", "--max_staleness", "2"],
    "sync_dynamic_batch": ["--dynamic_batch", "--train_max_tokens_per_gpu", "2048"],
}


def save_model(path: Path) -> None:
    """The long-tailed policy: the demo's tiny model fine-tuned by rlrun.sft on the demo prompts with responses of
    random printable characters, 85% of 4-24 characters and 15% longer than the cap (so the model learns to stop
    early mostly and sometimes never), saved as a user's SFT checkpoint would be."""
    rng = random.Random(0)
    data = path.parent / "sft.jsonl"
    sys.path.insert(0, str(REPO / "src"))
    from rlrun.models.tiny import BUILTIN_PROMPTS  # noqa: PLC0415 - the repo's package, not necessarily installed

    with data.open("w") as f:
        for i in range(2048):
            length = rng.randint(4, 24) if rng.random() < 0.85 else 200
            response = "".join(rng.choice(string.printable[:95]) for _ in range(length))
            f.write(json.dumps({"prompt": BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)]["prompt"], "response": response}) + "\n")
    cmd = [sys.executable, "-m", "rlrun.sft", "--dataset", str(data), "--input_key", "prompt", "--output_key", "response",
           "--max_len", "160", "--train_batch_size", "32", "--micro_train_batch_size", "32", "--learning_rate", "3e-3",
           "--max_epochs", "2", "--save_path", str(path)]
    proc = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, RLRUN_NO_PROGRESS="1"), capture_output=True, text=True,
                          timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"the SFT of the long-tailed model failed:\n{proc.stderr[-2000:]}")


def run(mode: str, steps: int, out: Path, ranks: int, model: Path, lr: str) -> list[dict]:
    half = str(ranks // 2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m", "rlrun.ppo",
           *ARGS, "--pretrain", str(model), "--actor_num_gpus_per_node", half, "--vllm_num_engines", half,
           "--actor_learning_rate", lr, "--max_steps", str(steps), "--save_path", str(out), *MODES[mode]]
    env = dict(os.environ, OMP_NUM_THREADS="1", RLRUN_NO_PROGRESS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def med(metrics: list[dict], key: str) -> float:
    return statistics.median(m.get(key, 0.0) for m in metrics[WARMUP:])


def summarise(mode: str, r: int, m: list[dict]) -> dict:
    tokens = [x["response_length"] * ROLLOUTS / x["time/step"] for x in m[WARMUP:]]
    return {"round": r, "mode": mode, "s_per_step": med(m, "time/step"), "trained_tokens_per_s": statistics.median(tokens),
            "response_length": med(m, "response_length"), "generate": med(m, "time/generate"),
            "engine_generate": med(m, "time/engine_generate"), "learn": med(m, "time/score") + med(m, "time/train"),
            "sync": med(m, "time/sync"), "padded_token_frac": med(m, "actor/padded_token_frac"),
            "staleness_mean": med(m, "async/staleness_mean"), "staleness_max": max(x.get("async/staleness_max", 0) for x in m),
            "partial_frac": med(m, "async/partial_frac"), "restarted_frac": med(m, "async/restarted_frac"),
            "rewards": [x["reward"] for x in m]}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - optional, only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {"sync": "tab:blue", "async": "tab:orange", "partial": "tab:green", "sync_dynamic_batch": "tab:gray"}
    for row in rows:
        ax.plot(range(1, len(row["rewards"]) + 1), row["rewards"], color=colours[row["mode"]], alpha=0.7,
                label=row["mode"] if row["round"] == 0 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("reward (batch mean)")
    ax.set_title("long-tailed GRPO, 1 actor + 1 engine rank (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the throughput runs")
    parser.add_argument("--steps", type=int, default=20, help="steps of each throughput run")
    parser.add_argument("--learn_steps", type=int, default=40, help="steps of each learning run (0: none)")
    parser.add_argument("--ranks", type=int, choices=(2, 4), default=2)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--plot", action="store_true", help="also write the reward curves as a PNG")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    modes = args.modes.split(",")
    rows, learning = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        save_model(model)
        # Throughput with the policy held still (learning rate 0): every mode generates from the same length
        # distribution, so tokens/s compares the loops, not where each run's learning took its lengths.
        for r in range(args.rounds):
            for mode in modes:
                rows.append(summarise(mode, r, run(mode, args.steps, Path(tmp) / f"{mode}{r}", args.ranks, model, "0")))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "rewards"}), flush=True)
        for mode in modes if args.learn_steps else ():
            if mode != "sync_dynamic_batch":  # the same updates as sync
                learning.append(summarise(mode, 0, run(mode, args.learn_steps, Path(tmp) / f"{mode}_learn", args.ranks,
                                                       model, LEARNING_RATE)))

    def median_of(mode: str, key: str) -> float:
        return statistics.median(row[key] for row in rows if row["mode"] == mode)

    summary: dict = {"ranks": args.ranks, "steps": args.steps, "rounds": args.rounds, "load": os.getloadavg(), "modes": {}}
    for mode in modes:
        summary["modes"][mode] = {key: median_of(mode, key) for key in
                                  ("s_per_step", "trained_tokens_per_s", "response_length", "padded_token_frac",
                                   "staleness_mean", "staleness_max", "partial_frac", "restarted_frac")}
    if "sync" in modes:
        base = summary["modes"]["sync"]
        for mode, s in summary["modes"].items():
            s["tokens_per_s_vs_sync"] = s["trained_tokens_per_s"] / base["trained_tokens_per_s"]
            s["step_speedup_vs_sync"] = base["s_per_step"] / s["s_per_step"]
        if "sync_dynamic_batch" in modes:
            before, after = base["padded_token_frac"], summary["modes"]["sync_dynamic_batch"]["padded_token_frac"]
            summary["padded_tokens_removed_by_dynamic_batch"] = 1 - after / before if before else 0.0
    summary["learning"] = {row["mode"]: {"learning_rate": LEARNING_RATE, "first3_reward": statistics.mean(row["rewards"][:3]),
                                         "last3_reward": statistics.mean(row["rewards"][-3:]),
                                         "response_length": row["response_length"], "rewards": row["rewards"]}
                           for row in learning}
    summary["rows"] = rows
    print(f"{'mode':20} {'s/step':>7} {'tokens/s':>9} {'vs sync':>8} {'len':>6} {'padded':>7} {'stale':>6} {'partial':>8}")
    for mode, s in summary["modes"].items():
        print(f"{mode:20} {s['s_per_step']:7.3f} {s['trained_tokens_per_s']:9.0f} {s.get('tokens_per_s_vs_sync', 0):8.2f} "
              f"{s['response_length']:6.1f} {s['padded_token_frac']:7.3f} {s['staleness_mean']:6.2f} {s['partial_frac']:8.2f}")
    if "padded_tokens_removed_by_dynamic_batch" in summary:
        print(f"--dynamic_batch removes {summary['padded_tokens_removed_by_dynamic_batch']:.0%} of the padded tokens")
    for mode, s in summary["learning"].items():
        print(f"learning rate {LEARNING_RATE}, {mode}: reward {s['first3_reward']:.3f} (first 3 steps) -> "
              f"{s['last3_reward']:.3f} (last 3), median length {s['response_length']:.1f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"async_train_{args.ranks}ranks.json").write_text(json.dumps(summary, indent=1))
    if args.plot and learning:
        plot(learning, args.out / f"async_train_{args.ranks}ranks.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
