"""Tests for rlrun.launch.transfer: the bucket plan (pure) and, with real gloo process groups in
separate processes, gather_from / broadcast_json and WeightSync (disaggregated, colocated, mismatch).

The multi-process scenarios share ONE launch (process start-up dominates on a small machine): four
copies of this file run as a script (`python test_transfer.py SCENARIOS RANK WORLD PORT OUTDIR`,
SCENARIOS comma-separated), every rank runs the scenarios in order and writes what it saw to
OUTDIR/rank{r}.{scenario}.pt (or a traceback to rank{r}.{scenario}.err, then stops); each test
then checks its scenario's files. Processes are joined with a deadline and killed past it, and the
process groups use short timeouts, so a broken collective fails the tests instead of hanging them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

from dataclasses import dataclass
from typing import Sequence

import pytest
import torch
import torch.distributed as dist
from torch import nn

from rlrun.engines.receivers import ALIGN, BucketEntry, BucketSink, KeptModel, bucket_size, entry_view, pack_buckets, chunk_bounds
from rlrun.weight_sync.sync import Route, build_weight_sync
from rlrun.weight_sync.wire import WireFormat
from rlrun.runtime.errors import RlrunError

DIST_TIMEOUT_S = 60  # a collective that never completes raises after this long (generous: shared CI boxes)
JOIN_TIMEOUT_S = 240  # the whole launch (about 10 s on an idle 2-core box), after which every rank is killed
BUCKET_BYTES = 2048  # small: several buckets, and some parameters larger than a bucket
# (bucket bytes, chunk bytes) for scenario_pipelined; TinyNet is 20 tensors of 64 B to 2.4 KiB (18.6 KiB)
PIPELINE_CASES = ((64, 1 << 20), (2048, 64), (1 << 30, 700), (1 << 30, 1 << 30))
F32 = torch.float32


# ---- pack_buckets / bucket_size / entry_view (pure) ---------------------------------------------


def _params(*numels: int, dtype: torch.dtype = F32) -> list[tuple[str, torch.Size, torch.dtype]]:
    return [(f"p{i}", torch.Size([n]), dtype) for i, n in enumerate(numels)]


def test_plan_preserves_order_and_aligns_every_offset():
    params = _params(3, 5, 1, 7, 2, 9) + [("scalar", torch.Size([]), torch.bfloat16), ("mat", torch.Size([3, 5]), torch.float16)]
    buckets = pack_buckets(params, bucket_bytes=64)
    flat = [e for b in buckets for e in b]
    assert [e.name for e in flat] == [n for n, _, _ in params]
    for bucket in buckets:
        assert bucket[0].offset == 0
        for prev, e in zip(bucket, bucket[1:]):
            assert e.offset % ALIGN == 0
            assert e.offset == -(-(prev.offset + prev.nbytes) // ALIGN) * ALIGN  # packed: only alignment padding
        assert bucket_size(bucket) % ALIGN == 0
        assert bucket_size(bucket) >= bucket[-1].offset + bucket[-1].nbytes
        assert bucket[-1].offset + bucket[-1].nbytes <= 64 or len(bucket) == 1
    assert flat[-2].shape == () and flat[-2].nbytes == 2
    assert flat[-1].shape == (3, 5) and flat[-1].nbytes == 30


def test_plan_oversize_parameter_gets_its_own_bucket():
    buckets = pack_buckets(_params(4, 100, 4, 4), bucket_bytes=64)  # p1 is 400 bytes
    assert [[e.name for e in b] for b in buckets] == [["p0"], ["p1"], ["p2", "p3"]]
    assert bucket_size(buckets[1]) == 400
    assert pack_buckets(_params(100), bucket_bytes=64)[0][0] == BucketEntry("p0", (100,), F32, 0, 400)


def test_plan_bucket_count_for_a_given_size():
    params = _params(*[256] * 10)  # ten 1 KiB tensors
    assert len(pack_buckets(params, 1024)) == 10
    assert len(pack_buckets(params, 2048)) == 5
    assert len(pack_buckets(params, 3 * 1024)) == 4  # 3 + 3 + 3 + 1
    assert len(pack_buckets(params, 1 << 30)) == 1
    assert len(pack_buckets(_params(3, 3, 3), 32)) == 2  # 12 bytes padded to 16: two per 32-byte bucket
    assert pack_buckets([], 1024) == []


def test_entry_view_round_trips_every_dtype():
    params = [("a", torch.Size([3]), F32), ("b", torch.Size([2, 3]), torch.bfloat16), ("c", torch.Size([5]), torch.int64),
              ("d", torch.Size([]), torch.float16)]
    (bucket,) = pack_buckets(params, 1 << 20)
    buffer = torch.zeros(bucket_size(bucket), dtype=torch.uint8)
    values = {"a": torch.randn(3), "b": torch.randn(2, 3).bfloat16(), "c": torch.arange(5) - 2, "d": torch.tensor(1.5).half()}
    for e in bucket:
        entry_view(buffer, e).copy_(values[e.name])
    for e in bucket:
        view = entry_view(buffer, e)
        assert view.dtype == values[e.name].dtype and torch.equal(view, values[e.name])
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()  # a view, not a copy


# ---- multi-process harness ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Launch:
    outdir: Path
    world: int
    timed_out: bool
    returncodes: list[int]
    outputs: list[str]

    def results(self, scenario: str) -> list[dict]:
        """Every rank's result for `scenario`, or a failure carrying the ranks' errors and output."""
        files = [self.outdir / f"rank{r}.{scenario}.pt" for r in range(self.world)]
        if all(f.exists() for f in files):
            return [torch.load(f, weights_only=False) for f in files]
        errors = sorted(p.read_text() for p in self.outdir.glob("rank*.err"))
        tails = "\n".join(f"--- rank {r} (rc={rc}) ---\n{out[-3000:]}"
                          for r, (rc, out) in enumerate(zip(self.returncodes, self.outputs)))
        raise AssertionError(f"scenario {scenario!r} has no result on every rank"
                             f"{' (the launch timed out)' if self.timed_out else ''}:\n" + "\n".join(errors) + "\n" + tails)


def _launch(scenarios: Sequence[str], world: int, outdir: Path) -> Launch:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, ",".join(scenarios), str(r), str(world), str(port), str(outdir)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    outputs, timed_out = [], False
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            p.kill()
            out, _ = p.communicate()
        outputs.append(out)
    return Launch(outdir, world, timed_out, [p.returncode for p in procs], outputs)


WORLD = 4
SCENARIO_ORDER = ("gather", "disaggregated", "streamed", "colocated_streamed", "colocated", "mismatch", "blocks", "pipelined", "together",
                  "zero_copy", "timeout")  # timeout last


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> Launch:
    return _launch(SCENARIO_ORDER, WORLD, tmp_path_factory.mktemp("transfer"))


# ---- models ---------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyNet(nn.Module):
    """Transformer-shaped: FSDPStrategy.wrap shards each Block, then the root. Odd widths so most
    tensors are not a multiple of 16 bytes and the bucket views need alignment padding."""

    _no_split_modules = ["Block"]

    def __init__(self, vocab: int = 37, d: int = 16, hidden: int = 35, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _seeded(seed: int, **kwargs) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet(**kwargs)


TOKENS = torch.arange(12).view(2, 6) % 37


# ---- worker side ----------------------------------------------------------------------------------


def _actor(group: dist.ProcessGroup):
    from rlrun.weight_sync.sources import ParamSource
    from rlrun.strategies.fsdp import FSDPStrategy

    strategy = FSDPStrategy(group, torch.device("cpu"), bf16=False, zero_stage=3, offload=False, gradient_checkpointing=False)
    model = strategy.wrap(_seeded(1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)

    def step(seed: int) -> None:  # every actor rank trains on its own data, FSDP reduces the grads
        g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
        loss = model(torch.randint(0, 37, (4, 6), generator=g)).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    def full() -> dict[str, torch.Tensor]:  # collective over the actor group
        return {n: t.clone() for n, t in strategy.full_params(model)}

    return ParamSource(model, strategy.param_blocks), step, full


def _reference_output(params: dict[str, torch.Tensor]) -> torch.Tensor:
    model = TinyNet()
    model.load_state_dict(params)
    with torch.no_grad():
        return model(TOKENS)


def _engine_snapshot(engine: nn.Module) -> dict:
    with torch.no_grad():
        return {"params": {n: p.detach().clone() for n, p in engine.named_parameters()},
                "ptrs": {n: p.data_ptr() for n, p in engine.named_parameters()},
                "output": engine(TOKENS)}


class _CollectiveCounter:
    """Counts the collectives a block of code issues through the two gather entry points:
    rlrun.strategies.blocks' byte all-gather ("block") and DTensor.full_tensor ("param")."""

    def __enter__(self) -> "_CollectiveCounter":
        from torch.distributed.tensor import DTensor

        import rlrun.strategies.blocks as pb

        self.calls = {"block": 0, "param": 0}
        self._saved = (pb._all_gather_single, DTensor.full_tensor)

        def block(*args, **kwargs):
            self.calls["block"] += 1
            return self._saved[0](*args, **kwargs)

        def param(*args, **kwargs):
            self.calls["param"] += 1
            return self._saved[1](*args, **kwargs)

        pb._all_gather_single, DTensor.full_tensor = block, param
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed.tensor import DTensor

        import rlrun.strategies.blocks as pb

        pb._all_gather_single, DTensor.full_tensor = self._saved


def scenario_disaggregated(rank: int, world: int) -> dict:
    """Actor = FSDP over [0, 1], engines = [2, 3] (different initial weights), sync = [0, 2, 3]."""
    actor_group = dist.new_group([0, 1])
    sync_group = dist.new_group([0, 2, 3])
    is_actor, is_engine = rank in (0, 1), rank in (2, 3)
    source, train_step, full = _actor(actor_group) if is_actor else (None, None, None)
    engine = _seeded(100 + rank) if is_engine else None
    out: dict = {}
    if is_engine:
        out["before"] = {n: p.detach().clone() for n, p in engine.named_parameters()}
    ws = build_weight_sync(actor_params=source, receiver=KeptModel(engine) if engine is not None else None, route=Route(root_group=sync_group if rank in (0, 2, 3) else None), wire=WireFormat(bucket_bytes=BUCKET_BYTES, dtype=F32), device=torch.device('cpu'))
    out["num_buckets"] = ws.num_buckets
    out["zero_copy"] = ws.zero_copy
    out["plan"] = [[(e.name, e.offset, e.nbytes) for e in b] for b in ws.buckets]
    buffer_ptrs = [b.data_ptr() for b in ws.buffers]
    if is_engine:  # engine parameters live inside the receive buckets
        out["bound"] = _engine_snapshot(engine)
        out["params_in_buffers"] = all(any(b.data_ptr() <= p.data_ptr() < b.data_ptr() + b.numel() for b in ws.buffers)
                                       for p in engine.parameters())
    out["syncs"] = []
    for k in range(2):
        if is_actor:
            train_step(k)
        ws.sync()
        snap: dict = {"buffer_ptrs": [b.data_ptr() for b in ws.buffers]}
        if is_actor:
            actor_full = full()
            if rank == 0:
                snap["actor"] = actor_full
                snap["reference_output"] = _reference_output(actor_full)
        if is_engine:
            snap["engine"] = _engine_snapshot(engine)
        out["syncs"].append(snap)
    out["buffer_ptrs_at_init"] = buffer_ptrs
    return out


class _RecordingSink(BucketSink):
    """A BucketSink that copies each bucket's tensors out at take() (what a file or a vLLM child does with them)
    and records the calls, so the order WeightSync drives it in and the buffers it lends can be checked. `model`: the
    engine's policy on the meta device (its names and shapes)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.calls: list[tuple] = []
        self.received: dict[str, torch.Tensor] = {}
        self.buffer_ptrs: set[int] = set()

    def start(self, buckets, buffers) -> None:
        self.buckets, self.buffers = buckets, buffers
        self.buffer_ptrs.update(b.data_ptr() for b in buffers)
        self.calls.append(("start", len(buckets), len(buffers)))

    def take(self, index: int) -> None:
        self.calls.append(("take", index))
        for e in self.buckets[index]:
            self.received[e.name] = entry_view(self.buffers[index % 2], e).clone()

    def release(self, index: int) -> None:
        self.calls.append(("release", index))

    def finish(self) -> None:
        self.calls.append(("finish",))


def scenario_streamed(rank: int, world: int) -> dict:
    """Actor = FSDP over [0, 1]; rank 2 an engine that keeps no copy (a sink, its model on the meta device); rank 3
    an engine rank outside the sync (a tensor-parallel engine's other rank): sync = [0, 2]. The engines check one
    parameter's sum after each sync (as LoRA's merged weights are)."""
    actor_group = dist.new_group([0, 1])
    sync_group = dist.new_group([0, 2])
    is_actor = rank in (0, 1)
    source, train_step, full = _actor(actor_group) if is_actor else (None, None, None)
    engine = None
    if rank in (2, 3):
        with torch.device("meta"):
            engine = TinyNet()
    sink = _RecordingSink(engine) if rank == 2 else None  # rank 3: the engine's other rank, its first takes them
    ws = build_weight_sync(actor_params=source, receiver=sink, route=Route(root_group=sync_group if rank in (0, 2) else None), wire=WireFormat(bucket_bytes=BUCKET_BYTES, dtype=F32), device=torch.device('cpu'), check_names=['blocks.1.up.weight'] if rank == 0 else ())
    out: dict = {"num_buckets": ws.num_buckets, "buffer_sizes": [b.numel() for b in ws.buffers], "syncs": [],
                 "bucket_sizes": [bucket_size(b) for b in ws.buckets]}
    for k in range(2):
        if is_actor:
            train_step(k)
        ws.sync()
        snap: dict = {}
        if is_actor:
            actor_full = full()
            if rank == 0:
                snap["actor"] = actor_full
        if sink is not None:
            snap["received"], snap["calls"] = dict(sink.received), list(sink.calls)
            sink.received.clear()
            sink.calls.clear()
        out["syncs"].append(snap)
    if sink is not None:
        out["buffer_ptrs"] = sorted(sink.buffer_ptrs)
        out["meta"] = all(p.is_meta for p in engine.parameters())
    return out


def scenario_colocated_streamed(rank: int, world: int) -> dict:
    """Actor = FSDP over [0, 1], engines colocated on them that keep no copy: rank 0's hands each bucket to a sink
    (a vLLM child's), rank 1's is a tensor-parallel engine's other rank (meta, no sink: it only gathers)."""
    actor_group = dist.new_group([0, 1])
    out: dict = {"syncs": []}
    if rank not in (0, 1):
        return out
    source, train_step, full = _actor(actor_group)
    with torch.device("meta"):
        engine = TinyNet()
    sink = _RecordingSink(engine) if rank == 0 else None  # rank 1: the engine's other rank, its first takes them
    ws = build_weight_sync(actor_params=source, receiver=sink, route=Route(colocated=True), wire=WireFormat(bucket_bytes=BUCKET_BYTES, dtype=F32), device=torch.device('cpu'))
    out["num_buckets"], out["buffers"] = ws.num_buckets, len(ws.buffers)
    for k in range(2):
        train_step(k)
        with _CollectiveCounter() as counter:
            ws.sync()
        snap: dict = {"actor": full(), "collectives": counter.calls}
        if sink is not None:
            snap["received"], snap["calls"] = dict(sink.received), list(sink.calls)
            sink.received.clear()
            sink.calls.clear()
        out["syncs"].append(snap)
    return out


def scenario_colocated(rank: int, world: int) -> dict:
    """Actor FSDP over [0, 1] with an engine model on the same ranks; ranks 2 and 3 hold neither
    (critic-only ranks in a real layout) and must be able to call sync() too."""
    actor_group = dist.new_group([0, 1])
    on_block = rank in (0, 1)
    source, train_step, full = _actor(actor_group) if on_block else (None, None, None)
    engine = _seeded(100 + rank) if on_block else None
    ws = build_weight_sync(actor_params=source, receiver=KeptModel(engine) if engine is not None else None, route=Route(colocated=True), wire=WireFormat(bucket_bytes=BUCKET_BYTES, dtype=F32), device=torch.device('cpu'))
    out: dict = {"num_buckets": ws.num_buckets, "syncs": []}
    if on_block:
        out["before"] = {n: p.detach().clone() for n, p in engine.named_parameters()}
    for k in range(2):
        if on_block:
            train_step(k)
        with _CollectiveCounter() as counted:
            ws.sync()
        if on_block:
            out["syncs"].append({"actor": full(), "engine": _engine_snapshot(engine), "collectives": counted.calls})
    return out


def scenario_mismatch(rank: int, world: int) -> dict:
    """Actor ranks [0, 1] (plain model), engines [2, 3] with a different architecture: the engines
    raise at construction, naming the parameters. Two cases: a shape differs, a layer is missing."""
    from rlrun.strategies.blocks import param_blocks
    from rlrun.weight_sync.sources import ParamSource

    sync_group = dist.new_group([0, 2, 3])
    out: dict = {}
    for case, engine_kwargs in (("shape", {"hidden": 36}), ("missing", {"layers": 2})):
        source = ParamSource(_seeded(1), param_blocks) if rank < 2 else None
        engine = _seeded(2, **engine_kwargs) if rank >= 2 else None
        try:
            build_weight_sync(actor_params=source, receiver=KeptModel(engine) if engine is not None else None, route=Route(root_group=sync_group if rank != 1 else None), wire=WireFormat(bucket_bytes=BUCKET_BYTES, dtype=F32), device=torch.device('cpu'))
            out[case] = None
        except RlrunError as e:
            out[case] = str(e)
    return out


def scenario_gather(rank: int, world: int) -> dict:
    """gather_from on its all-gather path (ranks == the group) and its broadcast path (a subset or
    another order), on the world and on the subgroup [1, 2]; plus all_gather_vectors and broadcast_json."""
    from rlrun.launch.transfer import all_gather_vectors, broadcast_json, gather_from

    cpu = torch.device("cpu")
    sub = dist.new_group([1, 2])
    world_group = dist.group.WORLD
    local = torch.arange(6, dtype=F32).view(2, 3) + 100 * rank
    everyone = list(range(world))
    out = {
        "all": gather_from(everyone, local, (2, 3), F32, world_group, cpu),  # all_gather path
        "halves": [gather_from(everyone[:2], local if rank < 2 else None, (2, 3), F32, world_group, cpu),
                   gather_from(everyone[2:], local if rank >= 2 else None, (2, 3), F32, world_group, cpu)],
        "reversed": gather_from(everyone[::-1], local, (2, 3), F32, world_group, cpu),
        "subset": gather_from([2, 0], local if rank in (0, 2) else None, (2, 3), F32, world_group, cpu),
        "vectors": all_gather_vectors(torch.full((4,), float(rank)), world_group),
        "json": broadcast_json({"from": rank, "names": ["a.b", "ü"]} if rank == 1 else None, 1, world_group, cpu),
    }
    if rank in (1, 2):
        out["sub_all"] = gather_from([1, 2], local, (2, 3), F32, sub, cpu)
        out["sub_one"] = gather_from([2], local if rank == 2 else None, (2, 3), F32, sub, cpu)
    return out


class Mixed(nn.Module):
    """Hand-made DTensor parameters over a 4-rank mesh: uneven dim-0 splits (5 rows: 2+2+1+0; 1 row:
    only rank 0 holds it), several dtypes in one gather buffer, a 0-dim parameter (not shardable:
    gathered by full_tensor), a Replicate one (full_tensor) and a plain tensor (no collective)."""

    SPECS = {"a": ((5, 3), torch.float32), "b": ((1, 7), torch.bfloat16), "c": ((8,), torch.float16),
             "d": ((9, 2, 3), torch.int64), "e": ((4, 4), torch.float64)}

    def __init__(self, mesh) -> None:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        super().__init__()
        g = torch.Generator().manual_seed(7)  # the same full values on every rank
        for name, (shape, dtype) in self.SPECS.items():
            full = (torch.randn(shape, generator=g) * 100).to(dtype)
            self.register_parameter(name, nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]), requires_grad=False))
        self.scalar = nn.Parameter(distribute_tensor(torch.tensor(3.25), mesh, [Replicate()]), requires_grad=False)
        self.rep = nn.Parameter(distribute_tensor(torch.arange(6.0).view(2, 3), mesh, [Replicate()]), requires_grad=False)
        self.plain = nn.Parameter(torch.arange(4, dtype=torch.float32), requires_grad=False)


def scenario_blocks(rank: int, world: int) -> dict:
    """param_blocks / ParamBlock.gather on (1) hand-made DTensors (uneven shards, mixed dtypes) and
    (2) the FSDP-wrapped TinyNet: full(), write() into fresh / strided / cast destinations, and the
    number of collectives per block."""
    from torch.distributed.device_mesh import DeviceMesh

    from rlrun.strategies.blocks import param_blocks
    from rlrun.strategies.fsdp import FSDPStrategy

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    mixed = Mixed(mesh)
    out: dict = {"local_rows": {n: p.to_local().shape[0] for n, p in mixed.named_parameters() if n in Mixed.SPECS}}
    blocks = param_blocks(mixed)
    out["mixed_blocks"] = [[n for n, _ in b.named] for b in blocks]
    with _CollectiveCounter() as counted:
        fb = blocks[0].gather()
    out["mixed_collectives"] = counted.calls
    out["mixed_full"] = {n: fb.full(n) for n in fb.names}
    out["mixed_expected"] = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                             for n, p in mixed.named_parameters()}
    strided = torch.zeros(3, 5, dtype=torch.float32).t()  # [5, 3], not contiguous
    out["write_strided"] = fb.write("a", strided).clone()
    out["write_cast"] = fb.write("c", torch.zeros(8, dtype=torch.float32))
    try:
        fb.write("a", torch.zeros(3, 5))
        out["wrong_shape"] = None
    except ValueError as e:
        out["wrong_shape"] = str(e)

    strategy = FSDPStrategy(dist.new_group([0, 1, 2, 3]), torch.device("cpu"), bf16=False, zero_stage=3, offload=False,
                            gradient_checkpointing=False)
    model = strategy.wrap(_seeded(5))
    out["tiny_blocks"] = [[n for n, _ in b.named] for b in strategy.param_blocks(model)]
    with _CollectiveCounter() as counted:
        full = {n: fb.full(n) for b in strategy.param_blocks(model) for fb in [b.gather()] for n in fb.names}
    out["tiny_collectives"] = counted.calls
    out["tiny_full"] = full
    out["tiny_expected"] = {n: t.clone() for n, t in strategy.full_params(model)}

    import rlrun.strategies.blocks as pb

    # FSDP over a one-rank group (an actor on one device): the shards are the full tensors, no collective
    solo_groups = [dist.new_group([r]) for r in range(world)]
    solo_strategy = FSDPStrategy(solo_groups[rank], torch.device("cpu"), bf16=False, zero_stage=3, offload=False,
                                 gradient_checkpointing=False)
    solo = solo_strategy.wrap(_seeded(5))
    with _CollectiveCounter() as counted:
        out["solo_full"] = {n: fb.full(n) for fb in pb.full_param_blocks(solo) for n in fb.names}
    out["solo_collectives"] = counted.calls
    out["solo_shares_memory"] = all(
        fb._plain[n].data_ptr() == dict(solo.named_parameters())[n].to_local().data_ptr()
        for fb in pb.full_param_blocks(solo) for n in fb.names)

    saved, pb.CPU_GATHER_PART_BYTES = pb.CPU_GATHER_PART_BYTES, 64  # split every unit into several all-gathers
    try:
        with _CollectiveCounter() as counted:
            scratch = pb.GatherScratch()  # shared by the blocks: each is read before the next gather
            out["parts_full"] = {n: fb.full(n) for fb in pb.full_param_blocks(model, scratch) for n in fb.names}
        out["parts_collectives"] = counted.calls
    finally:
        pb.CPU_GATHER_PART_BYTES = saved
    return out


def scenario_pipelined(rank: int, world: int) -> dict:
    """Disaggregated sync (actor FSDP over [0, 1], engines [2, 3]) under several bucket / chunk
    sizes: tiny buckets (most parameters larger than a bucket), many chunks per bucket, one bucket
    cut into many chunks, one bucket in one chunk; a fresh engine model for each, the actor training
    one step before each sync."""
    actor_group = dist.new_group([0, 1])
    sync_group = dist.new_group([0, 2, 3])
    is_actor, is_engine = rank in (0, 1), rank in (2, 3)
    source, train_step, full = _actor(actor_group) if is_actor else (None, None, None)
    out: dict = {"cases": []}
    for k, (bucket_bytes, chunk_bytes) in enumerate(PIPELINE_CASES):
        engine = _seeded(200 + 10 * k + rank) if is_engine else None
        ws = build_weight_sync(actor_params=source, receiver=KeptModel(engine) if engine is not None else None, route=Route(root_group=sync_group if rank in (0, 2, 3) else None), wire=WireFormat(bucket_bytes=bucket_bytes, dtype=F32, chunk_bytes=chunk_bytes), device=torch.device('cpu'))
        if is_actor:
            train_step(10 + k)
        case: dict = {"num_buckets": ws.num_buckets, "chunks": [len(c) for c in ws.chunks],
                      "buffers": [b.numel() for b in ws.buffers]}
        ws.sync()
        if is_actor:
            actor_full = full()
            if rank == 0:
                case["actor"] = actor_full
        if is_engine:
            case["engine"] = _engine_snapshot(engine)
        out["cases"].append(case)
    return out


def _tiny_groups(names: list[str]) -> list[list[str]]:
    """Groups to keep together that the gather order interleaves with other parameters: per block its three biases
    (placed at the norm's bias, ahead of up.weight) and its up/down weights."""
    blocks = sorted({n.split(".")[1] for n in names if n.startswith("blocks.")})
    return [g for b in blocks for g in ([f"blocks.{b}.norm.bias", f"blocks.{b}.up.bias", f"blocks.{b}.down.bias"],
                                        [f"blocks.{b}.up.weight", f"blocks.{b}.down.weight"])]


def scenario_together(rank: int, world: int) -> dict:
    """Disaggregated sync with groups kept together (`together`, as the native engine's fused projections): the
    plan places them ahead of parameters the root gathers first, so the root packs out of gather order and must put
    the chunks on the wire in plan order. Tiny buckets, many chunks, one bucket in many chunks."""
    actor_group = dist.new_group([0, 1])
    sync_group = dist.new_group([0, 2, 3])
    is_actor, is_engine = rank in (0, 1), rank in (2, 3)
    source, train_step, full = _actor(actor_group) if is_actor else (None, None, None)
    out: dict = {"cases": []}
    for k, (bucket_bytes, chunk_bytes) in enumerate(((64, 1 << 20), (600, 64), (1 << 30, 700))):
        engine = _seeded(300 + 10 * k + rank) if is_engine else None
        ws = build_weight_sync(actor_params=source, receiver=KeptModel(engine) if engine is not None else None, route=Route(root_group=sync_group if rank in (0, 2, 3) else None), wire=WireFormat(bucket_bytes=bucket_bytes, dtype=F32, chunk_bytes=chunk_bytes, together=_tiny_groups), device=torch.device('cpu'))
        if is_actor:
            train_step(20 + k)
        ws.sync()
        case: dict = {"plan": [[e.name for e in b] for b in ws.buckets], "chunks": ws.chunks}
        if is_actor:
            actor_full = full()
            if rank == 0:
                case["actor"] = actor_full
        if is_engine:
            params = dict(engine.named_parameters())
            case["engine"] = _engine_snapshot(engine)
            case["back_to_back"] = [all(params[a].data_ptr() + params[a].nbytes == params[b].data_ptr()
                                        for a, b in zip(group, group[1:]))
                                    for group in _tiny_groups(list(params))]
        out["cases"].append(case)
    return out


def scenario_zero_copy(rank: int, world: int) -> dict:
    """An actor on ONE rank (FSDP2 over [0]), engines [2, 3], sync [0, 2, 3]: the root's parameters move into its
    send buckets and each bucket is one broadcast with nothing packed. Rank 1 trains the same actor (its own
    one-rank group, same data) without a WeightSync, so the homed actor's training can be compared bit for bit.
    Then a stray: one parameter is given fresh memory (as a load with assign would), and the next sync must
    still deliver it and re-home it."""
    import rlrun.strategies.blocks as pb
    from rlrun.weight_sync.sources import ParamSource
    from rlrun.strategies import fsdp as fsdp_homing
    from rlrun.strategies.fsdp import FSDPStrategy

    groups = {r: dist.new_group([r]) for r in (0, 1)}
    sync_group = dist.new_group([0, 2, 3])
    out: dict = {}
    model = opt = strategy = None
    if rank in (0, 1):
        strategy = FSDPStrategy(groups[rank], torch.device("cpu"), bf16=False, zero_stage=2, offload=False,
                                gradient_checkpointing=False)
        model = strategy.wrap(_seeded(1))
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)

    def train(seed: int) -> None:
        loss = model(torch.randint(0, 37, (4, 6), generator=torch.Generator().manual_seed(seed))).logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    def locals_in(buffers: list[torch.Tensor]) -> bool:
        return all(any(b.data_ptr() <= p.to_local().data_ptr() < b.data_ptr() + b.numel() for b in buffers)
                   for p in model.parameters())

    ws = None
    if rank != 1:
        engine = _seeded(300 + rank) if rank in (2, 3) else None
        source = ParamSource(model, strategy.param_blocks, strategy) if rank == 0 else None
        ws = build_weight_sync(actor_params=source, receiver=KeptModel(engine) if engine is not None else None, route=Route(root_group=sync_group), wire=WireFormat(bucket_bytes=BUCKET_BYTES, dtype=F32), device=torch.device('cpu'))
        out.update(zero_copy=ws.zero_copy, chunks=[len(c) for c in ws.chunks], buffers=len(ws.buffers))
        if rank == 0:
            out["homed_at_start"] = locals_in(ws.buffers)
    writes = []
    saved_write = pb.FullBlock.write

    def counting_write(self, name, dest):
        writes.append(name)
        return saved_write(self, name, dest)

    out["syncs"] = []
    for k in range(3):
        if rank in (0, 1):
            if k == 2:  # a stray: the parameter's local tensor moves to fresh memory (same values)
                p = dict(model.named_parameters())["head.weight"]
                by_param = fsdp_homing._fsdp_params_by_param(model)
                fresh = p.to_local().clone()
                p._local_tensor = fresh
                by_param[id(p)]._sharded_param_data = fresh.view(-1)
            train(k)
        snap: dict = {}
        if ws is not None:
            writes.clear()
            pb.FullBlock.write = counting_write
            try:
                ws.sync()
            finally:
                pb.FullBlock.write = saved_write
            snap["writes"] = list(writes)
        if rank in (0, 1):
            snap["actor"] = {n: t.clone() for n, t in strategy.full_params(model)}
        if rank == 0:
            snap["homed"] = locals_in(ws.buffers)
        if rank in (2, 3):
            snap["engine"] = _engine_snapshot(ws.engine_model)
        out["syncs"].append(snap)
    return out


def scenario_timeout(rank: int, world: int) -> dict:
    """An engine whose root never sends: sync() must raise within the sync group's timeout (2 s),
    not hang. The root builds its WeightSync (the metadata broadcast) and then skips sync()."""
    from rlrun.strategies.blocks import param_blocks
    from rlrun.weight_sync.sources import ParamSource

    sync_group = dist.new_group([0, 2], timeout=timedelta(seconds=2))
    out: dict = {}
    if rank in (0, 2):
        ws = build_weight_sync(actor_params=ParamSource(_seeded(1), param_blocks) if rank == 0 else None, receiver=KeptModel(_seeded(2)) if rank == 2 else None, route=Route(root_group=sync_group), wire=WireFormat(bucket_bytes=BUCKET_BYTES, dtype=F32, chunk_bytes=512), device=torch.device('cpu'))
        if rank == 2:
            t0 = time.monotonic()
            try:
                ws.sync()
                out["error"] = None
            except Exception as e:  # noqa: BLE001 - whatever the backend raises, it must raise
                out["error"] = f"{type(e).__name__}: {e}"
            out["waited_s"] = time.monotonic() - t0
    return out


SCENARIOS = {f.__name__.removeprefix("scenario_"): f for f in
             (scenario_disaggregated, scenario_streamed, scenario_colocated_streamed, scenario_colocated, scenario_mismatch, scenario_gather, scenario_blocks,
              scenario_pipelined, scenario_together, scenario_zero_copy, scenario_timeout)}


def _worker_main(scenarios: str, rank: int, world: int, port: int, outdir: str) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=DIST_TIMEOUT_S))
    try:
        for scenario in scenarios.split(","):
            try:
                result = SCENARIOS[scenario](rank, world)
                dist.barrier()  # everyone finished before the next scenario (or teardown)
            except BaseException:  # the groups are in an unknown state: stop here
                (Path(outdir) / f"rank{rank}.{scenario}.err").write_text(f"rank {rank}, {scenario}:\n{traceback.format_exc()}")
                return 1
            torch.save(result, Path(outdir) / f"rank{rank}.{scenario}.pt")
        return 0
    finally:
        dist.destroy_process_group()


# ---- the multi-process tests ----------------------------------------------------------------------


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_disaggregated_sync_makes_engines_equal_to_actor_exactly(launched):
    r = launched.results("disaggregated")
    root, other_actor, engines = r[0], r[1], r[2:]
    assert root["num_buckets"] > 1
    assert other_actor["num_buckets"] == 0  # non-root actor ranks only join FSDP's all-gathers
    for e in engines:
        assert e["plan"] == root["plan"]  # both sides derived the same bucket plan from the metadata
        assert e["params_in_buffers"]
        assert any(not torch.equal(e["before"][n], root["syncs"][0]["actor"][n]) for n in e["before"])
        # binding copies the engine's own initial weights into the buckets
        _assert_same(e["bound"]["params"], e["before"])
    assert not torch.equal(root["syncs"][0]["actor"]["head.weight"], root["syncs"][1]["actor"]["head.weight"])
    for k in range(2):
        actor = root["syncs"][k]["actor"]
        for e in engines:
            snap = e["syncs"][k]
            _assert_same(snap["engine"]["params"], actor)
            assert torch.equal(snap["engine"]["output"], root["syncs"][k]["reference_output"])
            assert snap["engine"]["ptrs"] == e["bound"]["ptrs"]  # received in place, parameters never moved
    for rank in (0, 2, 3):  # buffers are allocated once and reused
        assert r[rank]["syncs"][0]["buffer_ptrs"] == r[rank]["syncs"][1]["buffer_ptrs"] == r[rank]["buffer_ptrs_at_init"]
    assert len(r[0]["buffer_ptrs_at_init"]) == 2  # the root double-buffers its send staging
    for rank in (2, 3):  # engines keep one receive buffer per bucket (their parameters live there)
        assert len(r[rank]["buffer_ptrs_at_init"]) == root["num_buckets"]


def test_streamed_sync_hands_each_bucket_to_the_sink_through_two_buffers_exactly(launched):
    """An engine with a sink receives every bucket into one of two staging buffers and hands it on: the sink gets the
    actor's weights exactly, each buffer is refilled only after the sink released its previous bucket, and the rank
    holds two buffers, never a copy of the model (its own stays on the meta device). An engine rank outside the sync
    takes no part."""
    r = launched.results("streamed")
    root, engine, outside = r[0], r[2], r[3]
    count = root["num_buckets"]
    assert count >= 4 and engine["num_buckets"] == count and outside["num_buckets"] == 0
    assert outside["syncs"] == [{}, {}] and engine["meta"]
    sizes = engine["bucket_sizes"]
    assert engine["buffer_sizes"] == [max(sizes[0::2]), max(sizes[1::2])] and len(engine["buffer_ptrs"]) == 2
    expected: list[tuple] = [("start", count, 2)]
    for k in range(count):  # bucket k + 2's receive is posted once bucket k, in the same buffer, was released
        expected += [("take", k)] + ([("release", k)] if k + 2 < count else [])
    expected.append(("finish",))
    for k in range(2):
        snap = engine["syncs"][k]
        assert snap["calls"] == expected
        actor = root["syncs"][k]["actor"]
        _assert_same({n: snap["received"][n] for n in actor}, actor)  # in the actor's gather order
        assert len(snap["received"]) == len(actor)
    assert not torch.equal(root["syncs"][0]["actor"]["head.weight"], root["syncs"][1]["actor"]["head.weight"])


def test_colocated_streamed_sync_packs_each_bucket_for_the_sink_and_other_ranks_only_gather(launched):
    r = launched.results("colocated_streamed")
    first, other = r[0], r[1]
    count = first["num_buckets"]
    assert count >= 4 and first["buffers"] == 2 and other["num_buckets"] == 0 and other["buffers"] == 0
    expected: list[tuple] = [("start", count, 2)]
    for k in range(count):  # filled in gather order; a buffer is refilled once its previous bucket was released
        expected += [("release", k - 2)] if k >= 2 else []
        expected.append(("take", k))
    expected.append(("finish",))
    for k in range(2):
        snap = first["syncs"][k]
        assert snap["calls"] == expected
        actor = snap["actor"]
        _assert_same({n: snap["received"][n] for n in actor}, actor)
        assert len(snap["received"]) == len(actor)
        # both ranks ran the actor's all-gathers only: one per FSDP unit, nothing else
        assert snap["collectives"] == other["syncs"][k]["collectives"] == {"block": 4, "param": 0}
    assert not torch.equal(first["syncs"][0]["actor"]["head.weight"], first["syncs"][1]["actor"]["head.weight"])
    assert r[2] == r[3] == {"syncs": []}


def test_colocated_sync_copies_actor_into_both_engine_copies(launched):
    r = launched.results("colocated")
    for rank in (0, 1):
        assert r[rank]["num_buckets"] == 0  # nothing crosses the wire beyond FSDP's own all-gathers
        assert any(not torch.equal(r[rank]["before"][n], r[0]["syncs"][0]["actor"][n]) for n in r[rank]["before"])
        for k in range(2):
            _assert_same(r[rank]["syncs"][k]["engine"]["params"], r[0]["syncs"][k]["actor"])
            _assert_same(r[rank]["syncs"][k]["actor"], r[0]["syncs"][k]["actor"])
            assert r[rank]["syncs"][k]["engine"]["ptrs"] == r[rank]["syncs"][0]["engine"]["ptrs"]
    assert not torch.equal(r[0]["syncs"][0]["actor"]["head.weight"], r[0]["syncs"][1]["actor"]["head.weight"])
    assert r[2] == r[3] == {"num_buckets": 0, "syncs": []}
    for rank in (0, 1):  # one all-gather per FSDP unit (the root's embed+head, 3 blocks), none per parameter
        assert [s["collectives"] for s in r[rank]["syncs"]] == [{"block": 4, "param": 0}] * 2


def test_engine_architecture_mismatch_raises_on_engine_ranks(launched):
    r = launched.results("mismatch")
    assert r[0] == r[1] == {"shape": None, "missing": None}  # the actor cannot know; the engines fail the run
    for rank in (2, 3):
        shape, missing = r[rank]["shape"], r[rank]["missing"]
        assert shape is not None and "blocks.0.up.weight" in shape and "shape differs" in shape
        assert missing is not None and "blocks.2." in missing and "missing on engine" in missing
        assert "same architecture" in shape


def test_gather_from_all_gather_and_broadcast_paths_agree(launched):
    world = WORLD
    r = launched.results("gather")
    part = [torch.arange(6, dtype=F32).view(2, 3) + 100 * k for k in range(world)]
    for rank in range(world):
        out = r[rank]
        assert torch.equal(out["all"], torch.cat(part))
        assert torch.equal(torch.cat(out["halves"]), out["all"])  # broadcast path == all-gather path
        assert torch.equal(out["reversed"], torch.cat(part[::-1]))
        assert torch.equal(out["subset"], torch.cat([part[2], part[0]]))
        assert torch.equal(out["vectors"], torch.arange(world, dtype=F32)[:, None].expand(world, 4))
        assert out["json"] == {"from": 1, "names": ["a.b", "ü"]}
    for rank in (1, 2):
        assert torch.equal(r[rank]["sub_all"], torch.cat(part[1:3]))
        assert torch.equal(r[rank]["sub_one"], part[2])
    assert "sub_all" not in r[0]


def test_block_gather_handles_uneven_shards_mixed_dtypes_and_non_sharded_params(launched):
    r = launched.results("blocks")
    # torch.chunk rows per rank: a 5 -> 2,2,1,0; b 1 -> 1,0,0,0; c 8 -> 2 each; d 9 -> 3,3,3,0; e 4 -> 1 each
    assert [r[k]["local_rows"] for k in range(WORLD)] == [
        {"a": 2, "b": 1, "c": 2, "d": 3, "e": 1}, {"a": 2, "b": 0, "c": 2, "d": 3, "e": 1},
        {"a": 1, "b": 0, "c": 2, "d": 3, "e": 1}, {"a": 0, "b": 0, "c": 2, "d": 0, "e": 1}]
    for rank in range(WORLD):
        out = r[rank]
        assert out["mixed_blocks"] == [["a", "b", "c", "d", "e", "scalar", "rep", "plain"]]  # no FSDP unit: one block
        # the five Shard(0) tensors in ONE byte all-gather; the 0-dim and Replicate ones via full_tensor
        assert out["mixed_collectives"] == {"block": 1, "param": 2}
        _assert_same(out["mixed_full"], out["mixed_expected"])
        assert torch.equal(out["mixed_full"]["plain"], torch.tensor([0.0, 1.0, 2.0, 3.0]))
        assert torch.equal(out["mixed_full"]["rep"], torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]))
        assert out["mixed_full"]["scalar"].shape == () and float(out["mixed_full"]["scalar"]) == 3.25
        assert torch.equal(out["write_strided"], out["mixed_expected"]["a"])
        assert out["write_cast"].dtype == F32 and torch.equal(out["write_cast"], out["mixed_expected"]["c"].float())
        assert out["wrong_shape"] is not None and "(3, 5)" in out["wrong_shape"] and "(5, 3)" in out["wrong_shape"]
        # FSDP-wrapped TinyNet over 4 ranks: the root unit (embed, head) first, then each Block
        assert out["tiny_blocks"] == [["embed.weight", "head.weight"]] + [
            [f"blocks.{i}.{n}" for n in ("norm.weight", "norm.bias", "up.weight", "up.bias", "down.weight", "down.bias")]
            for i in range(3)]
        assert out["tiny_collectives"] == {"block": 4, "param": 0}
        # 64-byte parts, per-rank shard bytes (4 ranks, torch.chunk rows, 16-byte aligned): root unit
        # embed 640 | head 640; each Block norm.w 16 + norm.b 16 | up.w 576 | up.b 48 | down.w 560 | down.b 16
        assert out["parts_collectives"] == {"block": 2 + 3 * 5, "param": 0}
        assert out["solo_collectives"] == {"block": 0, "param": 0} and out["solo_shares_memory"]
        _assert_same({n: out["solo_full"][n] for n in out["tiny_expected"]}, out["tiny_expected"])  # same seed
        _assert_same({n: out["parts_full"][n] for n in out["tiny_expected"]}, out["tiny_expected"])
        assert sorted(out["tiny_full"]) == sorted(out["tiny_expected"])
        _assert_same({n: out["tiny_full"][n] for n in out["tiny_expected"]}, out["tiny_expected"])


def test_pipelined_sync_is_exact_for_every_bucket_and_chunk_size(launched):
    r = launched.results("pipelined")
    root, engines = r[0], (r[2], r[3])
    # 64 B buckets: one per tensor; 2 KiB buckets: embed | head | b0.norm w+b | up.w | up.b | down.w |
    # b0.down.b + b1.norm w+b | ... | b2.down.b; then one bucket cut into 700 B chunks; one bucket, one chunk
    expected_buckets = [20, 15, 1, 1]
    for k, case in enumerate(root["cases"]):
        assert case["num_buckets"] == expected_buckets[k]
        assert len(case["buffers"]) == min(2, case["num_buckets"])  # root: two staging buffers at most
        for e in engines:
            assert e["cases"][k]["chunks"] == case["chunks"]
            assert len(e["cases"][k]["buffers"]) == case["num_buckets"]
            _assert_same(e["cases"][k]["engine"]["params"], case["actor"])
            assert torch.equal(e["cases"][k]["engine"]["output"], _reference_output(case["actor"]))
    assert root["cases"][0]["chunks"] == [1] * 20
    # 64 B chunks: the 64 B norm/bias tensors each get a chunk of their own inside their bucket
    assert root["cases"][1]["chunks"] == [1, 1, 2, 1, 1, 1, 3, 1, 1, 1, 3, 1, 1, 1, 1]
    assert root["cases"][2]["chunks"][0] > 4 and root["cases"][3]["chunks"] == [1]
    for k in range(1, 4):  # the actor trained between syncs: every case moved new weights
        assert not torch.equal(root["cases"][k - 1]["actor"]["head.weight"], root["cases"][k]["actor"]["head.weight"])


def test_groups_kept_together_land_back_to_back_in_the_engines_and_exact(launched):
    r = launched.results("together")
    root, engines = r[0], (r[2], r[3])
    groups = _tiny_groups([f"blocks.{b}.x" for b in range(3)])
    for k, case in enumerate(root["cases"]):
        where = {name: i for i, bucket in enumerate(case["plan"]) for name in bucket}
        flat = [name for bucket in case["plan"] for name in bucket]
        for group in groups:  # one bucket, consecutive, in the group's order
            assert len({where[n] for n in group}) == 1, (k, group)
            start = flat.index(group[0])
            assert flat[start:start + len(group)] == group
        # the biases' group sits where the norm's bias was gathered, ahead of up.weight
        assert flat.index("blocks.0.down.bias") < flat.index("blocks.0.up.weight")
        for e in engines:
            assert e["cases"][k]["plan"] == case["plan"] and e["cases"][k]["chunks"] == case["chunks"]
            assert all(e["cases"][k]["back_to_back"])
            _assert_same(e["cases"][k]["engine"]["params"], case["actor"])
            assert torch.equal(e["cases"][k]["engine"]["output"], _reference_output(case["actor"]))
    assert len(root["cases"][0]["plan"]) > 10 and len(root["cases"][2]["plan"]) == 1
    assert any(len(c) > 1 for c in root["cases"][1]["chunks"]) and len(root["cases"][2]["chunks"][0]) > 4
    for k in range(1, 3):  # the actor trained between syncs: every case moved new weights
        assert not torch.equal(root["cases"][k - 1]["actor"]["head.weight"], root["cases"][k]["actor"]["head.weight"])


def test_plan_keeps_groups_together_and_chunks_never_end_inside_one():
    # p1 and p3 (12 and 20 bytes) kept together at p1's place: back to back (12 is not a multiple of 16)
    params = _params(3, 3, 100, 5, 2)
    (bucket,) = pack_buckets(params, 1 << 20, [["p1", "p3"]])
    assert [(e.name, e.offset) for e in bucket] == [("p0", 0), ("p1", 16), ("p3", 28), ("p2", 48), ("p4", 448)]
    assert chunk_bounds(bucket, 1) == [(0, 16, 0), (16, 48, 2), (48, 448, 3), (448, 464, 4)]
    # a group is never split: with 40-byte buckets p1+p3 (32 bytes) start a bucket of their own
    assert [[e.name for e in b] for b in pack_buckets(params, 40, [["p1", "p3"]])] == [["p0"], ["p1", "p3"], ["p2"],
                                                                                     ["p4"]]
    with pytest.raises(ValueError, match="absent"):
        pack_buckets(params, 64, [["p1", "nope"]])


def test_zero_copy_sync_sends_a_one_rank_actors_own_memory_and_trains_identically(launched):
    r = launched.results("zero_copy")
    root, twin, engines = r[0], r[1], (r[2], r[3])
    assert root["zero_copy"] and all(e["zero_copy"] for e in engines)
    assert root["homed_at_start"]
    assert root["buffers"] == root["chunks"].__len__() > 1  # a buffer per bucket (not two staging buffers)
    assert root["chunks"] == [1] * len(root["chunks"])  # one broadcast per bucket
    for k, snap in enumerate(root["syncs"]):
        # the homed actor trained exactly as the same actor without a WeightSync
        _assert_same(snap["actor"], twin["syncs"][k]["actor"])
        for e in engines:
            _assert_same(e["syncs"][k]["engine"]["params"], snap["actor"])
        assert snap["homed"]
    assert root["syncs"][0]["writes"] == [] and root["syncs"][1]["writes"] == []  # nothing packed
    assert root["syncs"][2]["writes"] == ["head.weight"]  # the stray was copied once, then re-homed
    assert not torch.equal(root["syncs"][0]["actor"]["head.weight"], root["syncs"][2]["actor"]["head.weight"])


def test_sync_of_a_sharded_actor_packs(launched):
    """A two-rank actor's parameters are shards: the root gathers and packs, and says why."""
    r = launched.results("disaggregated")
    assert not r[0]["zero_copy"] and not r[2]["zero_copy"]


def test_sync_raises_instead_of_hanging_when_the_root_never_sends(launched):
    r = launched.results("timeout")
    err = r[2]["error"]
    # gloo words it either way: its own "Timed out", or "Application timeout caused pair closure" when the peer's
    # end of the pair timed out first (seen in CI); what matters is the bound below.
    assert err is not None and ("timed out" in err.lower() or "timeout" in err.lower()), err
    assert r[2]["waited_s"] < DIST_TIMEOUT_S  # the 2 s sync-group timeout, not the world's


def test_plan_chunks_tile_each_bucket_at_entry_boundaries():
    (bucket,) = pack_buckets(_params(3, 5, 100, 1, 2), bucket_bytes=1 << 20)  # offsets 0, 16, 48, 448, 464
    assert [e.offset for e in bucket] == [0, 16, 48, 448, 464]
    assert chunk_bounds(bucket, 32) == [(0, 48, 1), (48, 448, 2), (448, 480, 4)]
    assert chunk_bounds(bucket, 1 << 20) == [(0, 480, 4)]
    assert chunk_bounds(bucket, 1) == [(0, 16, 0), (16, 48, 1), (48, 448, 2), (448, 464, 3), (464, 480, 4)]
    assert chunk_bounds(bucket, 1 << 20)[-1][1] == bucket_size(bucket)


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
