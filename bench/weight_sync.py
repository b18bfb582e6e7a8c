"""Weight-sync benchmark: rlrun's bucketed WeightSync against the wire's own speed.

In ONE run, on the same process group (actor root = rank 0, engines = ranks 1..world-1), it times
  ours   WeightSync.sync() in disaggregated mode (pack parameters into the reusable byte buckets on
         the root, one broadcast per bucket, engine parameters are views into the receive buckets),
         for --bucket_mb and a sweep of other bucket sizes;
  raw    ONE broadcast of a single flat tensor with the same number of bytes (the floor);
  naive  one broadcast per parameter (what a straightforward implementation does);
  pack   the root's pack step alone (copying every parameter into the buckets, no wire),
and prints the median of --repeats (after --warmup untimed runs) and each method's ratio to raw.
Each timing is barrier -> op -> barrier on the sync group, the slowest rank's time; the methods are
timed round-robin so background load hits them alike. Memory: each rank holds one model copy plus
buckets per bucket size, so about (2 + 2 x bucket sizes) x size_mb.

    python bench/weight_sync.py                                 # 300 MB in 400 tensors, 2 ranks
    python bench/weight_sync.py --world 4 --size_mb 100 --bucket_mb 64 --sweep_mb 16,256

--demo_phases instead runs the demo for a few steps and prints each phase's share of a step:

    python bench/weight_sync.py --demo_phases [--demo_nproc 2] [--demo_steps 6]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ---- the transfer benchmark ------------------------------------------------------------------------


def tensor_shapes(size_mb: float, num_tensors: int, dtype_bytes: int) -> list[tuple[int, ...]]:
    """`num_tensors` shapes totalling ~size_mb MiB, shaped like a transformer's: every 4th is a small
    vector (norms, biases), the rest are matrices of a few different widths (deterministic)."""
    import random

    rng = random.Random(0)
    kinds = [("vec" if i % 4 == 3 else "mat", rng.choice((1.0, 1.0, 2.7, 0.25))) for i in range(num_tensors)]
    vec_elems = 1024
    n_vec = sum(k == "vec" for k, _ in kinds)
    mat_budget = max(size_mb * 2**20 / dtype_bytes - n_vec * vec_elems, 0)
    weight_sum = sum(w for k, w in kinds if k == "mat") or 1.0
    shapes = []
    for kind, w in kinds:
        if kind == "vec":
            shapes.append((vec_elems,))
        else:
            elems = max(int(mat_budget * w / weight_sum), 1)
            cols = 1024
            shapes.append((max(elems // cols, 1), cols))
    return shapes


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def bench_worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch import nn

    from rlrun.launch.transfer import ParamSource, WeightSync, entry_view

    torch.set_num_threads(1)
    world = args.world
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    group = dist.new_group(list(range(world)))  # the "sync" group: actor root + engines
    dtype = getattr(torch, args.dtype)
    cpu = torch.device("cpu")
    shapes = tensor_shapes(args.size_mb, args.num_tensors, torch.empty((), dtype=dtype).element_size())

    def make_model(seed: int) -> nn.Module:
        g = torch.Generator().manual_seed(seed)
        m = nn.Module()
        for i, s in enumerate(shapes):
            m.register_parameter(f"p{i:04d}", nn.Parameter(torch.randn(s, generator=g, dtype=torch.float32).to(dtype),
                                                            requires_grad=False))
        return m

    def plain_full_params(model: nn.Module):  # FSDPStrategy.full_params on an unsharded model
        for name, p in model.named_parameters():
            yield name, p.detach()

    is_root = rank == 0
    total_bytes = sum(math.prod(s) for s in shapes) * torch.empty((), dtype=dtype).element_size()

    def timed(fn) -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        dist.barrier(group=group)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
        return float(dt)

    # Every method is built first, then timed round-robin (raw, naive, ours@each bucket size, raw,
    # ...) so drifting background load hits them all alike.
    methods: list[dict] = []

    # (b) raw: one broadcast of a single flat tensor of the same byte count
    flat = torch.full((total_bytes,), 7 if is_root else 0, dtype=torch.uint8)
    methods.append({"method": "raw: 1 flat broadcast", "bucket_mb": None, "broadcasts": 1,
                    "fn": lambda: dist.broadcast(flat, src=0, group=group)})

    # (c) naive: one broadcast per parameter, straight from / into the parameters
    naive_params = [p.data for p in make_model(1 if is_root else 2 + rank).parameters()]
    methods.append({"method": "naive: 1 broadcast/param", "bucket_mb": None, "broadcasts": len(naive_params),
                    "fn": lambda: [dist.broadcast(t, src=0, group=group) for t in naive_params]})

    # (a) ours, for each bucket size (each with its own model: engine parameters become bucket views)
    syncs = []
    for bucket_mb in sorted({args.bucket_mb, *[float(x) for x in args.sweep_mb.split(",") if x]}):
        model = make_model(1 if is_root else 2 + rank)
        ws = WeightSync(actor_params=ParamSource(model, plain_full_params) if is_root else None,
                        engine_model=None if is_root else model, sync_group=group, actor_root=0, colocated=False,
                        bucket_bytes=int(bucket_mb * 2**20), wire_dtype=dtype, device=cpu)
        syncs.append((ws, model, [b.data_ptr() for b in ws.buffers]))
        methods.append({"method": "rlrun WeightSync.sync", "bucket_mb": bucket_mb, "broadcasts": ws.num_buckets,
                        "fn": ws.sync})

    for m in methods:
        m["times"] = []
    for round_ in range(args.warmup + args.repeats):
        for m in methods:
            dt = timed(m["fn"])
            if round_ >= args.warmup:
                m["times"].append(dt)
    raw = methods[0]["times"]

    rows: list[dict] = []
    checks = []
    for m in methods:
        rows.append(m)
        if m["method"] != "rlrun WeightSync.sync":
            continue
        ws, model, ptrs = syncs.pop(0)
        assert ptrs == [b.data_ptr() for b in ws.buffers], "bucket buffers were reallocated"
        # correctness: every engine holds the root's parameters (checksum over sampled raw bytes)
        s = torch.zeros(1, dtype=torch.float64)
        for p in model.parameters():
            s += p.detach().reshape(-1).view(torch.uint8)[::4096].double().sum()
        sums = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(sums, s, group=group)
        checks.append(all(float(x) == float(sums[0]) for x in sums))
        if is_root:  # pack only: what the root spends copying parameters into the buckets (no wire)
            def pack(ws=ws, model=model) -> None:
                it = plain_full_params(model)
                for bucket, buffer in zip(ws.buckets, ws.buffers):
                    for e in bucket:
                        entry_view(buffer, e).copy_(next(it)[1])
            pack_times = []
            for round_ in range(args.warmup + args.repeats):
                t0 = time.perf_counter()
                pack()
                if round_ >= args.warmup:
                    pack_times.append(time.perf_counter() - t0)
            rows.append({"method": "  of which root pack (memcpy)", "bucket_mb": m["bucket_mb"], "broadcasts": 0,
                         "times": pack_times})

    if is_root:
        report(args, rows, total_bytes, raw, all(checks))
    dist.destroy_process_group()


def report(args: argparse.Namespace, rows: list[dict], total_bytes: int, raw: list[float], ok: bool) -> None:
    raw_med = _median(raw)
    print(f"\nweight sync: {total_bytes / 2**20:.1f} MiB in {args.num_tensors} {args.dtype} tensors, "
          f"world {args.world} (root 0 -> {args.world - 1} engine rank(s)), gloo, "
          f"{os.cpu_count()} CPU cores, median of {args.repeats} rounds (methods interleaved) after {args.warmup} warm-up")
    print("'/ raw' = median / raw median (the ratio reported); 'min/min' = best / best, less sensitive to load")
    header = (f"{'method':<32}{'bucket MiB':>11}{'bcasts':>8}{'median s':>10}{'min s':>9}{'GB/s':>8}"
              f"{'/ raw':>8}{'min/min':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        med, lo = _median(r["times"]), min(r["times"])
        bucket = "" if r["bucket_mb"] is None else f"{r['bucket_mb']:g}"
        gbs = total_bytes / med / 1e9 if med > 0 else math.inf
        print(f"{r['method']:<32}{bucket:>11}{r['broadcasts']:>8}{med:>10.3f}{lo:>9.3f}{gbs:>8.2f}{med / raw_med:>8.2f}"
              f"{lo / min(raw):>9.2f}")
    print(f"engines hold the root's parameters after every WeightSync: {'yes' if ok else 'NO'}")
    summary = {"size_mib": total_bytes / 2**20, "num_tensors": args.num_tensors, "world": args.world,
               "raw_s": raw_med, **{f"{r['method'].strip()}@{r['bucket_mb']}": _median(r["times"]) for r in rows}}
    print("json:", json.dumps(summary))
    if not ok:
        sys.exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_transfer_bench(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(bench_worker, args=(args, free_port()), nprocs=args.world, join=True)


# ---- the demo's phase shares ------------------------------------------------------------------------

PHASES = ("time/generate", "time/score", "time/train", "time/sync")


def run_demo_phases(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-") as tmp:
        metrics = Path(tmp) / "m.jsonl"
        if args.demo_nproc:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.demo_nproc}",
                   "-m", "rlrun.ppo"]
        else:
            cmd = [sys.executable, "-m", "rlrun.ppo"]
        cmd += ["--config", str(REPO / "configs" / "demo.yaml"), "--max_steps", str(args.demo_steps),
                "--save_path", tmp, "--metrics_file", str(metrics), *args.demo_args.split()]
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", RLRUN_NO_PROGRESS="1", PYTHONUNBUFFERED="1")
        print("running:", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(proc.stdout[-4000:], proc.stderr[-4000:], sep="\n", file=sys.stderr)
            sys.exit(f"the demo failed (exit {proc.returncode})")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "time/step" in r and r.get("step", 0) >= 2]  # step 1 pays one-off warm-up
    if not steps:
        sys.exit(f"no step >= 2 in the metrics file ({len(rows)} rows)")
    step_s = statistics.mean(r["time/step"] for r in steps)
    print(f"\ndemo ({args.demo_nproc or 1} process(es), {os.cpu_count()} CPU cores): steps "
          f"{steps[0]['step']}..{steps[-1]['step']} averaged, {step_s:.3f} s/step, whole run {wall:.1f} s wall")
    print(f"{'phase':<16}{'mean s':>9}{'% of step':>11}")
    for phase in PHASES:
        share = statistics.mean(r.get(phase, 0.0) / r["time/step"] for r in steps)
        print(f"{phase:<16}{statistics.mean(r.get(phase, 0.0) for r in steps):>9.4f}{100 * share:>10.2f}%")
    other = statistics.mean(1 - sum(r.get(p, 0.0) for p in PHASES) / r["time/step"] for r in steps)
    print(f"{'(rest)':<16}{'':>9}{100 * other:>10.2f}%")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size_mb", type=float, default=300, help="total parameter MiB")
    p.add_argument("--num_tensors", type=int, default=400)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--bucket_mb", type=float, default=256, help="WeightSync bucket size (MiB)")
    p.add_argument("--sweep_mb", default="32,1024", help="more bucket sizes to time, comma-separated ('' for none)")
    p.add_argument("--world", type=int, default=2, help="ranks: actor root + (world-1) engine ranks")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--demo_phases", action="store_true", help="time the demo's phases instead")
    p.add_argument("--demo_steps", type=int, default=6)
    p.add_argument("--demo_nproc", type=int, default=0, help="0: plain python; N: torchrun with N ranks")
    p.add_argument("--demo_args", default="", help="extra rlrun.ppo flags, e.g. a disaggregated layout")
    args = p.parse_args(argv)
    if args.demo_phases:
        run_demo_phases(args)
        return
    if args.world < 2:
        p.error("--world must be >= 2 (the actor root and at least one engine rank)")
    run_transfer_bench(args)


if __name__ == "__main__":
    main()
