"""Weight-sync benchmark: rlrun's WeightSync against the wire's own speed, both layouts.

Disaggregated (engines on other ranks). In ONE run, on the same process group (actor root = rank 0,
engines = ranks 1..world-1), timed round-robin:
  raw       ONE broadcast of a single flat tensor with the same number of bytes (the floor);
  raw, async the same flat bytes as async broadcasts of the first --chunk_mb each (the floor for a
            chunked pipeline; on a loaded box two gloo worker threads can beat one broadcast);
  naive     one broadcast per parameter (what a straightforward implementation does);
  previous  the algorithm before the pipeline: pack a whole bucket, then a blocking broadcast of it;
  ours      WeightSync.sync(): the root packs into two alternating staging buffers and puts each
            ~chunk_mb chunk on the wire (async) as soon as it is packed, while it packs the next;
            engine parameters are views into the receive buckets. For --bucket_mb and each of
            --sweep_mb, for each --chunk_mb;
  zero-copy WeightSync.sync() from a root that is a one-rank FSDP2 actor: its parameters live in
            the send buckets, each bucket is one broadcast, nothing is packed;
  pack      the root's pack step alone (copying every parameter into the staging, no wire).
Colocated (engine ranks == actor ranks, actor FSDP2-sharded over all ranks, --colocated_preset):
  per parameter  one full_tensor() all-gather per parameter, then a copy (the code before);
  per FSDP unit  WeightSync.sync(): one gather per fully_shard'ed module, written straight into the
                 engine; with the number of collectives of one sync of each;
  LoRA merged    the same with a LoRA actor (r 16, all-linear): each unit's base + scaling * B @ A is computed
                 before it is written (rlrun.weight_sync.sources), and two merged tensors are checked.
Each timing is barrier -> op -> barrier, the slowest rank's time; medians of --repeats rounds after
--warmup, and each method's ratio to raw (or to per-parameter); the load average is printed with
each table. Both parts check that the engines end bit-identical to the actor.

    python bench/weight_sync.py --quick                         # ~1 min: 64 MiB, 16 MiB buckets, preset 3m
    python bench/weight_sync.py                                 # 300 MiB in 400 tensors + colocated 100m, 2 ranks
    python bench/weight_sync.py --only disaggregated --chunk_mb 4,16,64 --sweep_mb ''
    python bench/weight_sync.py --world 4 --size_mb 100 --bucket_mb 64 --sweep_mb 16,256

--senders instead compares, side by side in one world of 8 ranks, at each actor/engine layout of --layouts (2/1,
4/1, 4/4, 6/2), an FSDP2 actor of --size_mb fp32 MiB synced into bf16 engines (rlrun's native engine keeps them):
  root      today's path before issue 63: the actor's first rank gathers every unit and broadcasts the buckets;
  many      every actor rank sends its own shard in bf16 (rlrun.weight_sync.senders);
  delta     many with --weight_sync_delta, after an update that moves every weight by 1e-6 (Adam's step at lr 1e-6
            is about that: each element moves by about lr), so a few % of the bf16 weights change;
and, with --lora_preset, a LoRA actor into native engines: merged (the path before issue 63) vs the adapters alone;
seconds (median, min, max of --repeats rounds, each after one such update), MiB sent by the busiest actor rank and
received per engine rank (counted by the syncs: the root path's root posts each bucket once and the backend fans it
out), the most bytes of new tensors alive at once during a sync (max over the actor ranks; LiveTensorBytes) and the
sync's resident buffers on an actor rank; every engine is checked bit-identical to the actor after every round:

    python bench/weight_sync.py --senders [--size_mb 64] [--layouts 4/4,6/2] [--repeats 5]

--demo_phases instead runs the demo for a few steps and prints each phase's share of a step:

    python bench/weight_sync.py --demo_phases [--demo_nproc 2] [--demo_steps 6]
"""

from __future__ import annotations

import argparse
import resource
import itertools
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


def _timed(group, fn) -> float:
    """barrier -> fn -> barrier on `group`; the slowest rank's seconds."""
    import torch
    import torch.distributed as dist

    dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    dist.barrier(group=group)
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
    return float(dt)


def _run_rounds(group, methods: list[dict], warmup: int, repeats: int) -> None:
    """Time every method round-robin so drifting background load hits them all alike."""
    for m in methods:
        m["times"] = []
    for round_ in range(warmup + repeats):
        for m in methods:
            dt = _timed(group, m["fn"])
            if round_ >= warmup:
                m["times"].append(dt)


def bench_worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world,
                            timeout=timedelta(seconds=600))
    if args.only in ("all", "disaggregated"):
        disaggregated_bench(rank, args)
    if args.only in ("all", "colocated"):
        colocated_bench(rank, args)
    dist.destroy_process_group()


def disaggregated_bench(rank: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from torch.distributed.tensor import DTensor

    from rlrun.strategies.blocks import param_blocks
    from rlrun.engines.receivers import KeptModel, bucket_size, entry_view
    from rlrun.weight_sync.sources import ParamSource
    from rlrun.weight_sync.sync import Route, build_weight_sync
    from rlrun.weight_sync.wire import WireFormat
    from rlrun.strategies.fsdp import FSDPStrategy

    world = args.world
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

    is_root = rank == 0
    total_bytes = sum(math.prod(s) for s in shapes) * torch.empty((), dtype=dtype).element_size()
    methods: list[dict] = []

    # (b) raw: one broadcast of a single flat tensor of the same byte count
    flat = torch.full((total_bytes,), 7 if is_root else 0, dtype=torch.uint8)
    methods.append({"method": "raw: 1 flat broadcast", "bucket_mb": None, "broadcasts": 1,
                    "fn": lambda: dist.broadcast(flat, src=0, group=group)})

    # (b') the same flat bytes as async broadcasts of one chunk size each, waited at the end: the floor
    # for a chunked pipeline (on a loaded box, two gloo worker threads can beat one monolithic broadcast)
    chunk_mbs = [float(x) for x in str(args.chunk_mb).split(",") if x]
    if args.raw_chunked:
        step = int(chunk_mbs[0] * 2**20)

        def raw_chunked() -> None:
            works = [dist.broadcast(flat[i:i + step], src=0, group=group, async_op=True) for i in range(0, total_bytes, step)]
            for w in works:
                w.wait()

        methods.append({"method": f"raw: flat, async {chunk_mbs[0]:g} MiB", "bucket_mb": None,
                        "broadcasts": -(-total_bytes // step), "fn": raw_chunked})

    # (c) naive: one broadcast per parameter, straight from / into the parameters
    naive_params = [p.data for p in make_model(1 if is_root else 2 + rank).parameters()]
    if not args.no_naive:
        methods.append({"method": "naive: 1 broadcast/param", "bucket_mb": None, "broadcasts": len(naive_params),
                        "fn": lambda: [dist.broadcast(t, src=0, group=group) for t in naive_params]})

    # (a) ours, for each bucket size (each with its own model: engine parameters become bucket views),
    # and the previous algorithm on the same plan: pack a whole bucket, then a blocking broadcast of it
    syncs = []
    root_group = dist.new_group([0])  # every rank takes part in creating it
    root_strategy = FSDPStrategy(root_group, cpu, bf16=False, zero_stage=2, offload=False,
                                 gradient_checkpointing=False) if is_root else None
    bucket_mbs = sorted({args.bucket_mb, *[float(x) for x in args.sweep_mb.split(",") if x]})
    for bucket_mb, chunk_mb in itertools.product(bucket_mbs, chunk_mbs):
        model = make_model(1 if is_root else 2 + rank)
        ws = build_weight_sync(actor_params=ParamSource(model, param_blocks) if is_root else None, receiver=None if is_root else KeptModel(model), route=Route(root_group=group), wire=WireFormat(bucket_bytes=int(bucket_mb * 2 ** 20), dtype=dtype, chunk_bytes=int(chunk_mb * 2 ** 20)), device=cpu)
        syncs.append((ws, model, [b.data_ptr() for b in ws.buffers]))
        chunks = sum(len(c) for c in ws.chunks)
        if args.previous and chunk_mb == chunk_mbs[0]:
            prev_buffers = [torch.empty(bucket_size(b), dtype=torch.uint8) for b in ws.buckets] if is_root else ws.buffers

            def previous(ws=ws, model=model, prev_buffers=prev_buffers) -> None:
                if is_root:
                    params = dict(model.named_parameters())
                    for bucket, buffer in zip(ws.buckets, prev_buffers):
                        for e in bucket:
                            entry_view(buffer, e).copy_(params[e.name].detach())
                        dist.broadcast(buffer, src=0, group=group)
                else:
                    for buffer in ws.buffers:
                        dist.broadcast(buffer, src=0, group=group)

            methods.append({"method": "previous: pack, then bcast", "bucket_mb": bucket_mb,
                            "broadcasts": ws.num_buckets, "fn": previous})
        methods.append({"method": f"rlrun WeightSync, chunk {chunk_mb:g}", "bucket_mb": bucket_mb, "broadcasts": chunks,
                        "fn": ws.sync})
        if chunk_mb == chunk_mbs[0]:  # the root is a one-rank FSDP2 actor: its parameters live in the buckets
            model = make_model(1 if is_root else 2 + rank)
            source = None
            if is_root:
                model = root_strategy.wrap(model)
                source = ParamSource(model, root_strategy.param_blocks, root_strategy)
            ws = build_weight_sync(actor_params=source, receiver=None if is_root else KeptModel(model), route=Route(root_group=group), wire=WireFormat(bucket_bytes=int(bucket_mb * 2 ** 20), dtype=dtype), device=cpu)
            assert ws.zero_copy, "the one-rank FSDP2 root did not take the zero-copy send"
            syncs.append((ws, model, [b.data_ptr() for b in ws.buffers]))
            methods.append({"method": "rlrun WeightSync, zero-copy", "bucket_mb": bucket_mb,
                            "broadcasts": ws.num_buckets, "fn": ws.sync})

    _run_rounds(group, methods, args.warmup, args.repeats)
    raw = methods[0]["times"]

    rows: list[dict] = []
    checks = []
    for m in methods:
        rows.append(m)
        if not m["method"].startswith("rlrun WeightSync"):
            continue
        ws, model, ptrs = syncs.pop(0)
        assert ptrs == [b.data_ptr() for b in ws.buffers], "bucket buffers were reallocated"
        ws.sync()  # the last timed method may have been 'previous': end on ours before checking
        # correctness: every engine holds the root's parameters (checksum over sampled raw bytes)
        s = torch.zeros(1, dtype=torch.float64)
        for p in model.parameters():
            t = p.detach().to_local() if isinstance(p, DTensor) else p.detach()  # the zero-copy root is FSDP2
            s += t.reshape(-1).view(torch.uint8)[::4096].double().sum()
        sums = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(sums, s, group=group)
        checks.append(all(float(x) == float(sums[0]) for x in sums))
        if is_root and m["method"].endswith(f"chunk {chunk_mbs[0]:g}"):  # pack only: what the root spends copying parameters into the staging buffers (no wire)
            def pack(ws=ws, model=model) -> None:
                params = dict(model.named_parameters())
                for k, bucket in enumerate(ws.buckets):
                    for e in bucket:
                        entry_view(ws.buffers[k % 2], e).copy_(params[e.name].detach())
            pack_times = []
            for round_ in range(args.warmup + args.repeats):
                t0 = time.perf_counter()
                pack()
                if round_ >= args.warmup:
                    pack_times.append(time.perf_counter() - t0)
            rows.append({"method": "  root pack alone (memcpy)", "bucket_mb": m["bucket_mb"], "broadcasts": 0,
                         "times": pack_times})

    if is_root:
        report(args, rows, total_bytes, raw, all(checks))
    dist.barrier(group=group)


def report(args: argparse.Namespace, rows: list[dict], total_bytes: int, raw: list[float], ok: bool) -> None:
    raw_med = _median(raw)
    print(f"\nweight sync, disaggregated: {total_bytes / 2**20:.1f} MiB in {args.num_tensors} {args.dtype} tensors, "
          f"world {args.world} (root 0 -> {args.world - 1} engine rank(s)), gloo, "
          f"{os.cpu_count()} CPU cores, median of {args.repeats} rounds (methods interleaved) after {args.warmup} warm-up, "
          f"load average {_load()}")
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
    print("json:", json.dumps(summary), flush=True)
    if not ok:
        sys.exit(1)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def colocated_bench(rank: int, args: argparse.Namespace) -> None:
    """Colocated sync (engine ranks == actor ranks): the actor is FSDP2-sharded over all ranks, each rank
    holds an engine copy. Per parameter (the previous code: one full_tensor() all-gather per parameter,
    then a copy) against per FSDP unit (WeightSync: one all-gather per unit, written straight into the
    engine), interleaved; also counts the collectives of one sync of each."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from rlrun.engines.receivers import KeptModel
    from rlrun.weight_sync.sources import ParamSource
    from rlrun.weight_sync.sync import Route, build_weight_sync
    from rlrun.weight_sync.wire import WireFormat
    from rlrun.models.tiny import build_causal_lm, tiny_model_config_for_size
    import rlrun.strategies.blocks as fsdp  # the per-unit all-gather lives there
    from rlrun.strategies.fsdp import FSDPStrategy

    group = dist.new_group(list(range(args.world)))
    cpu = torch.device("cpu")
    config = tiny_model_config_for_size(args.colocated_preset)
    strategy = FSDPStrategy(group, cpu, bf16=False, zero_stage=3, offload=False, gradient_checkpointing=False)
    actor = strategy.wrap(build_causal_lm(config, seed=1), trainable=False)
    engine = build_causal_lm(config, seed=2)
    targets = dict(engine.named_parameters())
    ws = build_weight_sync(actor_params=ParamSource(actor, strategy.param_blocks), receiver=KeptModel(engine), route=Route(colocated=True), wire=WireFormat(bucket_bytes=256 * 2 ** 20, dtype=torch.float32), device=cpu)

    def per_param() -> None:
        with torch.no_grad():
            for name, full in strategy.full_params(actor):
                targets[name].data.copy_(full)

    counts = {}
    for label, fn in (("per parameter (full_tensor)", per_param), ("per FSDP unit (WeightSync)", ws.sync)):
        calls = {"n": 0}
        saved = (fsdp._all_gather_single, DTensor.full_tensor)

        def count(orig):
            def wrapped(*a, **k):
                calls["n"] += 1
                return orig(*a, **k)
            return wrapped

        fsdp._all_gather_single, DTensor.full_tensor = count(saved[0]), count(saved[1])
        try:
            fn()
        finally:
            fsdp._all_gather_single, DTensor.full_tensor = saved
        counts[label] = calls["n"]
    # LoRA (--lora_rank 16, all-linear): the same base with adapters, engines get base + scaling * B @ A per unit.
    from transformers import AutoModelForCausalLM

    from rlrun.models.lora import LoraSettings, add_adapters
    from rlrun.models.weights import Unfilled, params_on_meta, state_dict_weights
    from rlrun.weight_sync.sources import MergedLoraParams
    from rlrun.weight_sync.wire import WireFormat

    with params_on_meta():
        skeleton = AutoModelForCausalLM.from_config(config)
    lora = LoraSettings(16, 32.0, ("all-linear",))
    lora_actor = strategy.wrap(add_adapters(Unfilled(skeleton, state_dict_weights(build_causal_lm(config, seed=1))),
                                            lora, seed=1))
    with torch.no_grad():  # trained adapters: B away from its zero start
        for name, p in lora_actor.named_parameters():
            if ".lora_B." in name:
                p.fill_(0.01)
    lora_engine = build_causal_lm(config, seed=2)
    lora_source = MergedLoraParams(lora_actor, strategy.param_blocks, lora.scaling)
    lora_ws = build_weight_sync(actor_params=lora_source, receiver=KeptModel(lora_engine), route=Route(colocated=True), wire=WireFormat(bucket_bytes=256 * 2 ** 20, dtype=torch.float32), device=cpu, check_names=lora_source.check_names())
    methods = [{"method": "per parameter (full_tensor)", "fn": per_param},
               {"method": "per FSDP unit (WeightSync)", "fn": ws.sync},
               {"method": "LoRA r16, merged per unit", "fn": lora_ws.sync}]
    _run_rounds(group, methods, args.warmup, args.repeats)
    ws.sync()
    full = dict(strategy.full_params(actor))
    merged = dict(lora_source.full())
    lora_targets = dict(lora_engine.named_parameters())
    exact = torch.tensor([float(all(torch.equal(targets[n], full[n]) for n in full)
                                and all(torch.equal(lora_targets[n], merged[n]) for n in merged))])
    dist.all_reduce(exact, op=dist.ReduceOp.MIN, group=group)
    n_params = sum(p.numel() for p in actor.parameters())
    if rank == 0:
        base = _median(methods[0]["times"])
        print(f"\nweight sync, colocated: preset {args.colocated_preset} ({n_params / 1e6:.1f}M params, "
              f"{n_params * 4 / 2**20:.0f} MiB fp32, {len(full)} tensors, {len(strategy.param_blocks(actor))} FSDP units), "
              f"FSDP2 over {args.world} ranks, gloo, median of {args.repeats} rounds (interleaved) after {args.warmup} "
              f"warm-up, load average {_load()}")
        header = f"{'method':<32}{'collectives':>12}{'median s':>10}{'min s':>9}{'/ per param':>13}"
        print(header)
        print("-" * len(header))
        for m in methods:
            med = _median(m["times"])
            calls = counts.get(m["method"], "-")
            print(f"{m['method']:<32}{calls:>12}{med:>10.3f}{min(m['times']):>9.3f}{med / base:>13.2f}")
        print(f"engine weights bit-identical to the actor's (LoRA: to base + adapter merged) after WeightSync: "
              f"{'yes' if exact.item() == 1 else 'NO'}")
        print("json:", json.dumps({"preset": args.colocated_preset, "world": args.world,
                                   **{m["method"]: _median(m["times"]) for m in methods},
                                   **{f"collectives {k}": v for k, v in counts.items()}}), flush=True)
    if exact.item() != 1:
        sys.exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_transfer_bench(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"
    mp.spawn(bench_worker, args=(args, free_port()), nprocs=args.world, join=True)


# ---- many senders vs the root path -----------------------------------------------------------------------------

SENDER_KINDS = ("root", "many", "delta")


def senders_worker(rank: int, args: argparse.Namespace, port: int) -> None:
    """One rank of the --senders world: every layout in turn (every rank makes every group, in the same order)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world,
                            timeout=timedelta(seconds=600))
    rows = [senders_layout(rank, args, *map(int, layout.split("/"))) for layout in args.layouts.split(",")]
    if args.lora_preset:
        rows += [adapters_layout(rank, args, *map(int, layout.split("/"))) for layout in args.layouts.split(",")]
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


def _units(size_mb: float, num_tensors: int):
    """A transformer-shaped module of fp32 parameters (tensor_shapes), ten tensors per FSDP unit."""
    import torch
    from torch import nn

    class Unit(nn.Module):
        def __init__(self, shapes) -> None:
            super().__init__()
            self.weights = nn.ParameterList(nn.Parameter(torch.randn(s) * 0.02) for s in shapes)

    class Model(nn.Module):
        _no_split_modules = ["Unit"]

        def __init__(self) -> None:
            super().__init__()
            shapes = tensor_shapes(size_mb, num_tensors, 4)
            self.units = nn.ModuleList(Unit(shapes[i : i + 10]) for i in range(0, len(shapes), 10))

    torch.manual_seed(0)
    return Model()


def senders_layout(rank: int, args: argparse.Namespace, actors: int, engines: int) -> dict:
    import torch
    import torch.distributed as dist

    from rlrun.engines.receivers import KeptModel
    from rlrun.runtime.memory import LiveTensorBytes
    from rlrun.strategies.fsdp import FSDPStrategy
    from rlrun.weight_sync.sources import ParamSource
    from rlrun.weight_sync.sync import Route, build_weight_sync
    from rlrun.weight_sync.wire import WireFormat

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    actor_ranks, receivers = tuple(range(actors)), tuple(range(actors, actors + engines))
    members = (*actor_ranks, *receivers)
    groups = [dist.new_group(list(r)) for r in (actor_ranks, (0, *receivers), members, members)]
    actor_group, root_group, senders_group, everyone = (g if rank in r else None for g, r in
                                                        zip(groups, (actor_ranks, (0, *receivers), members, members)))
    row: dict = {"layout": f"{actors}/{engines}"}
    if rank not in members:
        dist.barrier()
        return row
    source = model = engine_copies = None
    if rank in actor_ranks:
        strategy = FSDPStrategy(actor_group, cpu, bf16=False, zero_stage=3, offload=False, gradient_checkpointing=False)
        model = strategy.wrap(_units(args.size_mb, args.num_tensors))
        source = ParamSource(model, strategy.param_blocks, strategy)
    else:
        engine_copies = {kind: KeptModel(_units(args.size_mb, args.num_tensors).to(bf16)) for kind in SENDER_KINDS}
    wire = WireFormat(bucket_bytes=int(args.bucket_mb * 2**20), dtype=bf16)
    root_route = Route(root_group=root_group, actor_ranks=actor_ranks)
    syncs = {kind: build_weight_sync(actor_params=source, receiver=engine_copies[kind] if engine_copies else None,
                                     route=root_route if kind == "root" else Route(root_group=root_group,
                                     actor_ranks=actor_ranks, senders_group=senders_group),
                                     wire=WireFormat(wire.bucket_bytes, bf16, delta=kind == "delta"), device=cpu)
             for kind in SENDER_KINDS}
    times: dict[str, list[float]] = {kind: [] for kind in SENDER_KINDS}
    cpu = {kind: 0.0 for kind in SENDER_KINDS}  # this rank's CPU seconds per sync (user + system, its threads too)
    stats = {kind: {"sent": 0, "received": 0, "peak": 0} for kind in SENDER_KINDS}
    identical = True
    for round_ in range(args.warmup + args.repeats + 1):
        if model is not None and round_:  # an update like Adam's at lr 1e-6: every weight moves by about 1e-6
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p).sign_() * 1e-6)
        measure = round_ == args.warmup + args.repeats  # the last round measures memory, untimed (the meter slows
        for kind, sync in syncs.items():  # every op down)
            live = LiveTensorBytes()
            before = resource.getrusage(resource.RUSAGE_SELF)
            if measure:
                with live:
                    sync.sync()
            else:
                seconds = _timed(everyone, sync.sync)
            after = resource.getrusage(resource.RUSAGE_SELF)
            if round_ < args.warmup:  # the first sync: buffers made, a delta's first (full) sync
                continue
            if not measure:
                times[kind].append(seconds)
                cpu[kind] += (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / args.repeats
            stats[kind] = {"sent": max(stats[kind]["sent"], sync.traffic.sent),
                           "received": max(stats[kind]["received"], sync.traffic.received),
                           "peak": max(stats[kind]["peak"], live.peak)}
        full = {n: t.to(bf16) for n, t in strategy.full_params(model)} if model is not None else None
        if rank == 0:
            dist.broadcast_object_list([full], src=0, group=everyone)
        else:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=everyone)
            full = box[0]
        if engine_copies:
            identical &= all(torch.equal(p, full[n]) for kept in engine_copies.values()
                             for n, p in kept.model.named_parameters())
    resident = {kind: sum(t.numel() * t.element_size() for t in getattr(sync, "staging", [])) +
                (sync.last.numel() * sync.last.element_size() if getattr(sync, "last", None) is not None else 0) +
                (sum(t.numel() * t.element_size() for t in sync.buffers) if kind == "root" and rank == 0 else 0)
                for kind, sync in syncs.items()}
    mine = torch.tensor([[stats[k]["sent"], stats[k]["received"], stats[k]["peak"], resident[k]] for k in SENDER_KINDS],
                        dtype=torch.float64)
    actor_max, engine_max = mine.clone() * (rank in actor_ranks), mine.clone() * (rank in receivers)
    for t in (actor_max, engine_max):
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=everyone)
    cpu_sum = torch.tensor([cpu[k] for k in SENDER_KINDS], dtype=torch.float64)
    dist.all_reduce(cpu_sum, group=everyone)
    ok = torch.tensor([1.0 if identical else 0.0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=everyone)
    dist.barrier()
    for i, kind in enumerate(SENDER_KINDS):
        row[kind] = {"median_s": _median(times[kind]), "min_s": min(times[kind]), "max_s": max(times[kind]),
                     "actor_sent_mib": float(actor_max[i, 0]) / 2**20, "engine_received_mib": float(engine_max[i, 1]) / 2**20,
                     "actor_peak_new_mib": float(actor_max[i, 2]) / 2**20,
                     "actor_resident_mib": float(actor_max[i, 3]) / 2**20, "cpu_s": float(cpu_sum[i])}
    row["identical"] = bool(ok.item())
    row["shard_bf16_mib"] = args.size_mb / 2 / actors
    return row


def adapters_layout(rank: int, args: argparse.Namespace, actors: int, engines: int) -> dict:
    """A LoRA actor (rank 16, all-linear, FSDP2, --lora_preset) into native engines: the merged weights (the path
    before issue 63) against the adapters alone; seconds, bytes, and the engines' logits after the last sync."""
    import torch
    import torch.distributed as dist

    from rlrun.config.model import PretrainedConfig
    from rlrun.engines.native.engine import NativeEngine
    from rlrun.engines.protocol import SamplingSettings
    from rlrun.models.loading import load_causal_lm, unfilled_policy
    from rlrun.models.lora import LoraSettings, add_adapters
    from rlrun.roles.update import make_optimizer
    from rlrun.strategies.fsdp import FSDPStrategy
    from rlrun.weight_sync.sources import AdapterParams, MergedLoraParams
    from rlrun.weight_sync.sync import Route, build_weight_sync
    from rlrun.weight_sync.wire import WireFormat

    cpu = torch.device("cpu")
    actor_ranks, receivers = tuple(range(actors)), tuple(range(actors, actors + engines))
    members = (*actor_ranks, *receivers)
    specs = (actor_ranks, (0, *receivers), members)
    actor_group, root_group, everyone = (g if rank in r else None for g, r in zip([dist.new_group(list(r)) for r in specs], specs))
    row: dict = {"layout": f"{actors}/{engines}", "lora": args.lora_preset}
    if rank not in members:
        dist.barrier()
        return row
    source = PretrainedConfig(model_preset=args.lora_preset, lora_rank=16, lora_alpha=32)
    settings = LoraSettings.of(source)
    params = {}
    engines_of = {}
    if rank in actor_ranks:
        strategy = FSDPStrategy(actor_group, cpu, bf16=False, zero_stage=3, offload=False, gradient_checkpointing=False)
        actor, _ = strategy.wrap_trainable(add_adapters(unfilled_policy(source, 0), settings, 0),
                                           lambda m: make_optimizer(m, 1e-3, (0.9, 0.95), 0.0))
        with torch.no_grad():
            for name, p in actor.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0, 0.01)
        params = {"merged": MergedLoraParams(actor, strategy.param_blocks, settings.scaling),
                  "adapters": AdapterParams(actor, strategy.param_blocks)}
    else:
        sampling = SamplingSettings(1.0, 1.0, 4, 0, (1,))
        engines_of = {kind: NativeEngine(load_causal_lm(source, 0), sampling, cpu) for kind in ("merged", "adapters")}
        engines_of["adapters"].run_adapters(settings.scaling)
    route = Route(root_group=root_group, actor_ranks=actor_ranks)
    syncs = {kind: build_weight_sync(actor_params=params.get(kind), receiver=engines_of[kind].weights if engines_of else None,
                                     route=route, wire=WireFormat(int(args.bucket_mb * 2**20), torch.float32), device=cpu,
                                     check_names=params[kind].check_names() if params else ())
             for kind in ("merged", "adapters")}
    times: dict[str, list[float]] = {kind: [] for kind in syncs}
    for round_ in range(args.warmup + args.repeats):
        for kind, sync in syncs.items():
            seconds = _timed(everyone, sync.sync)
            if round_ >= args.warmup:
                times[kind].append(seconds)
    close = torch.tensor([1.0])
    if engines_of:
        ids = torch.tensor([[5, 17, 42, 99, 7, 3]])
        out = {}
        for kind, engine in engines_of.items():
            with engine.decoder.weights():
                out[kind] = engine.decoder.prefill(ids, torch.ones_like(ids, dtype=torch.bool), engine.decoder.new_cache(1, 8))
        close[0] = float(torch.allclose(out["merged"], out["adapters"], rtol=1e-4, atol=1e-4))
    sent = torch.tensor([float(syncs[k].traffic.sent) for k in syncs], dtype=torch.float64)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX, group=everyone)
    dist.all_reduce(close, op=dist.ReduceOp.MIN, group=everyone)
    dist.barrier()
    for i, kind in enumerate(syncs):
        row[kind] = {"median_s": _median(times[kind]), "min_s": min(times[kind]), "max_s": max(times[kind]),
                     "root_sent_mib": float(sent[i]) / 2**20}
    row["same_logits"] = bool(close.item())
    return row


def run_senders_bench(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"
    args.world = max(sum(map(int, layout.split("/"))) for layout in args.layouts.split(","))
    with tempfile.TemporaryDirectory(prefix="rlrun-bench-") as tmp:
        args.out = str(Path(tmp) / "rows.json")
        mp.spawn(senders_worker, args=(args, free_port()), nprocs=args.world, join=True)
        rows = json.loads(Path(args.out).read_text())
    print(f"\nweight sync, {args.size_mb:g} MiB fp32 actor (FSDP2) -> bf16 engines, {args.bucket_mb:g} MiB buckets, "
          f"{args.repeats} rounds, {os.cpu_count()} CPU cores, load {_load()}")
    print("| actor/engine | path | median s (min-max) | vs root | CPU s, all ranks | busiest actor rank sends MiB | engine rank receives "
          "MiB | actor: new tensors during a sync MiB | actor: resident sync buffers MiB | engines exact |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "lora" in row:
            continue
        for kind in SENDER_KINDS:
            r = row[kind]
            print(f"| {row['layout']} | {kind} | {r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}) | "
                  f"{r['median_s'] / row['root']['median_s']:.2f} | {r['cpu_s']:.3f} | {r['actor_sent_mib']:.2f} | "
                  f"{r['engine_received_mib']:.2f} | {r['actor_peak_new_mib']:.2f} | {r['actor_resident_mib']:.2f} | "
                  f"{'yes' if row['identical'] else 'NO'} |")
    lora_rows = [row for row in rows if "lora" in row]
    if lora_rows:
        print(f"\nLoRA (rank 16, all-linear, fp32, preset {args.lora_preset}) into native engines: merged vs adapters only")
        print("| actor/engine | path | median s (min-max) | vs merged | root sends MiB | engines' logits agree |")
        print("|---|---|---|---|---|---|")
        for row in lora_rows:
            for kind in ("merged", "adapters"):
                r = row[kind]
                print(f"| {row['layout']} | {kind} | {r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}) | "
                      f"{r['median_s'] / row['merged']['median_s']:.2f} | {r['root_sent_mib']:.2f} | "
                      f"{'yes' if row['same_logits'] else 'NO'} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"size_mb": args.size_mb, "bucket_mb": args.bucket_mb,
                                               "repeats": args.repeats, "rows": rows}, indent=1))
    if not all(row.get("identical", row.get("same_logits")) for row in rows):
        sys.exit("an engine's weights differ from the actor's")


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
    p.add_argument("--chunk_mb", default="16", help="WeightSync wire chunk size(s) (MiB, comma-separated): the pipeline step")
    p.add_argument("--world", type=int, default=2, help="ranks: actor root + (world-1) engine ranks")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--only", default="all", choices=("all", "disaggregated", "colocated"))
    p.add_argument("--colocated_preset", default="100m", choices=("tiny", "3m", "100m", "0.5b"),
                   help="model for the colocated per-parameter vs per-FSDP-unit comparison")
    p.add_argument("--no_naive", action="store_true", help="skip the slow one-broadcast-per-parameter row")
    p.add_argument("--no_raw_chunked", dest="raw_chunked", action="store_false",
                   help="skip the row timing the flat bytes as async broadcasts of the first --chunk_mb")
    p.add_argument("--no_previous", dest="previous", action="store_false",
                   help="skip the previous algorithm's row (pack a whole bucket, then a blocking broadcast)")
    p.add_argument("--quick", action="store_true",
                   help="small and fast: 64 MiB / 100 tensors, 16 MiB buckets in 4 MiB chunks, 5 rounds, colocated preset 3m")
    p.add_argument("--senders", action="store_true", help="many senders vs the root path (see above) instead")
    p.add_argument("--layouts", default="2/1,4/1,4/4,6/2", help="--senders: actor/engine ranks, comma-separated")
    p.add_argument("--json", default="", help="--senders: also write the table's numbers to this file")
    p.add_argument("--lora_preset", default="3m", help="--senders: also LoRA merged vs adapters on this tiny model "
                   "preset (tiny, 3m, 100m; '' to skip)")
    p.add_argument("--demo_phases", action="store_true", help="time the demo's phases instead")
    p.add_argument("--demo_steps", type=int, default=6)
    p.add_argument("--demo_nproc", type=int, default=0, help="0: plain python; N: torchrun with N ranks")
    p.add_argument("--demo_args", default="", help="extra rlrun.ppo flags, e.g. a disaggregated layout")
    args = p.parse_args(argv)
    if args.quick:
        args.size_mb, args.num_tensors, args.bucket_mb, args.sweep_mb, args.chunk_mb = 64, 100, 16, "", "4"
        args.repeats, args.colocated_preset, args.no_naive = 5, "3m", True
    if args.demo_phases:
        run_demo_phases(args)
        return
    if args.senders:
        run_senders_bench(args)
        return
    if args.world < 2:
        p.error("--world must be >= 2 (the actor root and at least one engine rank)")
    run_transfer_bench(args)


if __name__ == "__main__":
    main()
