"""Many senders (rlrun.weight_sync.senders) against the root path (rlrun.weight_sync.broadcast) in one world of 8
real gloo ranks, at two layouts: 4 actor + 4 engine ranks, and 6 actor + 2 engine ranks. The actor is FSDP2-sharded
in fp32 over its ranks (odd widths: uneven shards, a tail rank with fewer rows; tied embeddings) and the engines
take bf16; after each of three updates both paths sync into their own engine copy, and the engines must be
bit-identical. Also counted in code: the bytes each actor rank sends (its shard, once, in bf16) and what a sync
allocates on an actor rank (nothing beyond its two stripe buffers, which together stay under one bucket).

This file is also the per-rank worker (`python test_many_senders.py RANK WORLD PORT OUTDIR`)."""

from __future__ import annotations

import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

WORLD = 8
LAYOUTS = {"4+4": (4, 4), "6+2": (6, 2)}
BUCKET_BYTES = 3000  # several buckets; the embedding (37 x 18 bf16 = 1.3 KiB) and the ups share some
BF16 = torch.bfloat16


class Block(nn.Module):
    """A gated MLP block (Qwen's shape): RMSNorm, gate and up projections, down projection."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(self.norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class Tied(nn.Module):
    """Odd widths (37, 18, 35: no dimension divides by 4 or 6) and an output head tied to the embedding."""

    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 18)
        self.blocks = nn.ModuleList(Block(18, 35) for _ in range(3))
        self.head = nn.Linear(18, 37, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def seeded(seed: int) -> Tied:
    torch.manual_seed(seed)
    return Tied()


# Each update's learning rate: a full sync first; a small step (few bf16 weights change: a sparse delta); a skipped
# step (nothing changes); a large step (most change: dense again)
LRS = (0.05, 1e-6, 0.0, 0.05)


def scenario(layout: str, rank: int) -> dict:
    """Every rank runs it (groups are made by every rank, in the same order). Three syncs side by side into three
    engine copies: the root path, many senders, many senders with delta; then a corrupted engine value."""
    from rlrun.engines.receivers import KeptModel
    from rlrun.runtime.memory import LiveTensorBytes
    from rlrun.strategies.fsdp import FSDPStrategy
    from rlrun.weight_sync.senders import ManySendersSync
    from rlrun.weight_sync.sources import ParamSource
    from rlrun.weight_sync.sync import Route, build_weight_sync
    from rlrun.weight_sync.wire import WireFormat

    actors, engines = LAYOUTS[layout]
    actor_ranks, receivers = tuple(range(actors)), tuple(range(actors, actors + engines))
    timeout = timedelta(seconds=60)
    actor_group = dist.new_group(list(actor_ranks), timeout=timeout)
    root_group = dist.new_group([0, *receivers], timeout=timeout)
    senders_group = dist.new_group([*actor_ranks, *receivers], timeout=timeout)
    wire = WireFormat(bucket_bytes=BUCKET_BYTES, dtype=BF16, chunk_bytes=512)
    cpu = torch.device("cpu")
    source, strategy, model = None, None, None
    if rank in actor_ranks:
        strategy = FSDPStrategy(actor_group, cpu, bf16=False, zero_stage=3, offload=False, gradient_checkpointing=False)
        model = strategy.wrap(seeded(1))
        source = ParamSource(model, strategy.param_blocks, strategy)
    kinds = ("root", "many", "delta")
    kept = {kind: KeptModel(seeded(2 + i).to(BF16)) for i, kind in enumerate(kinds)} if rank in receivers else {}
    root_route = Route(root_group=root_group if rank in (0, *receivers) else None, actor_ranks=actor_ranks)
    many_route = replace(root_route, senders_group=senders_group if rank in (*actor_ranks, *receivers) else None)
    syncs = {
        kind: build_weight_sync(
            actor_params=source,
            receiver=kept.get(kind),
            route=root_route if kind == "root" else many_route,
            wire=replace(wire, delta=kind == "delta"),
            device=cpu,
        )
        for kind in kinds
    }
    many, delta = syncs["many"], syncs["delta"]
    assert isinstance(many, ManySendersSync) and isinstance(delta, ManySendersSync) and delta.delta
    out: dict = {"syncs": [], "buckets": many.num_buckets}
    if model is not None:
        out["shard_bytes"] = sum(h.flat.numel() * BF16.itemsize for h in source.holdings(actor_ranks))
        out["staging_bytes"] = sum(t.numel() * t.element_size() for t in many.staging)
        out["delta_copy_bytes"] = delta.last.numel() * delta.last.element_size()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step, lr in enumerate(LRS):
        if model is not None and lr:
            for group in opt.param_groups:
                group["lr"] = lr
            g = torch.Generator().manual_seed(step * 100 + rank)
            model(torch.randint(0, 37, (4, 6), generator=g)).logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
        snap: dict = {}
        for kind, sync in syncs.items():
            counted = LiveTensorBytes()
            with counted:
                sync.sync()
            traffic = getattr(sync, "traffic", None)
            snap[kind] = {"allocated": counted.peak, "sent": traffic.sent if traffic else None,
                          "received": traffic.received if traffic else None}
            if kind in kept:
                snap[kind]["engine"] = {n: p.detach().clone() for n, p in kept[kind].model.named_parameters()}
        if model is not None and strategy is not None:
            full = {n: t.to(BF16) for n, t in strategy.full_params(model)}
            if rank == 0:
                snap["actor"] = full
        out["syncs"].append(snap)
    # A corrupted engine copy: the next delta sync (nothing changed) must say so on that engine rank, and only there
    if rank == receivers[-1]:
        with torch.no_grad():
            dict(kept["delta"].model.named_parameters())["blocks.1.down.bias"][3] += 1
    try:
        delta.sync()
        out["corrupted"] = None
    except Exception as e:  # noqa: BLE001 - the test checks its type and words
        out["corrupted"] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    from helpers import run_file_as_ranks

    outdir = tmp_path_factory.mktemp("many_senders")
    run_file_as_ranks(__file__, WORLD, outdir, timeout=240)
    return {name: [torch.load(outdir / f"rank{r}.{name}.pt", weights_only=False) for r in range(WORLD)] for name in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_engines_get_the_root_paths_weights_bit_for_bit_after_every_sync(results, layout):
    """Many senders and many senders with delta, after each of a large step, a small step, a skipped step and a large
    step: every engine rank's copy equals the root path's, and the actor's weights in bf16, bit for bit."""
    actors, engines = LAYOUTS[layout]
    ranks = results[layout]
    for k in range(len(LRS)):
        actor = ranks[0]["syncs"][k]["actor"]
        assert "embed.weight" in actor and "head.weight" not in actor  # tied: one parameter, sent once
        if k:
            moved = not torch.equal(actor["blocks.0.gate_up.weight"], ranks[0]["syncs"][k - 1]["actor"]["blocks.0.gate_up.weight"])
            assert moved == (LRS[k] != 0)
        for e in range(actors, actors + engines):
            snap = ranks[e]["syncs"][k]
            for kind in ("many", "delta"):
                assert list(snap[kind]["engine"]) == list(snap["root"]["engine"])
                for name, value in snap["root"]["engine"].items():
                    assert value.dtype == BF16 and torch.equal(snap[kind]["engine"][name], value), (layout, k, e, name)
                    assert torch.equal(value, actor[name])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_actor_rank_sends_its_shard_once_in_the_wire_dtype_and_allocates_under_a_bucket(results, layout):
    actors, engines = LAYOUTS[layout]
    ranks = results[layout]
    model_bytes = sum(t.numel() * BF16.itemsize for t in ranks[0]["syncs"][0]["actor"].values())
    assert sum(ranks[a]["shard_bytes"] for a in range(actors)) == model_bytes  # the shards tile the model
    assert len({ranks[a]["shard_bytes"] for a in range(actors)}) > 1  # uneven: a tail rank holds fewer rows
    assert ranks[0]["buckets"] > 2
    assert ranks[0]["syncs"][0]["root"]["allocated"] > 0  # the meter sees allocations: the root path's first gathers
    for a in range(actors):
        assert ranks[a]["staging_bytes"] <= BUCKET_BYTES
        assert ranks[a]["delta_copy_bytes"] == ranks[a]["shard_bytes"]  # delta keeps its shard's last sync, no more
        for snap in ranks[a]["syncs"]:
            assert ranks[a]["shard_bytes"] <= snap["many"]["sent"] <= 1.05 * ranks[a]["shard_bytes"]
            assert snap["many"]["received"] == 0
            assert snap["many"]["allocated"] <= BUCKET_BYTES and snap["delta"]["allocated"] <= BUCKET_BYTES
    for e in range(actors, actors + engines):  # every engine rank gets the whole model; with several, each passes on
        for snap in ranks[e]["syncs"]:  # what it took from its actor ranks to the others
            assert snap["many"]["received"] == model_bytes
    passed_on = sum(ranks[e]["syncs"][0]["many"]["sent"] for e in range(actors, actors + engines))
    assert passed_on == model_bytes * (engines - 1)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_delta_sync_sends_what_changed_and_a_drifted_engine_copy_is_one_clear_error(results, layout):
    """Delta: the first sync is full; after a small step the actor ranks send under 10 % of a full sync; after a
    skipped step only the headers; after a large step most parts go dense again. A value changed on one engine rank
    since the last sync fails that rank's next sync with one error naming the part, and no other rank."""
    actors, engines = LAYOUTS[layout]
    ranks = results[layout]
    full = [sum(ranks[a]["syncs"][k]["many"]["sent"] for a in range(actors)) for k in range(len(LRS))]
    delta = [sum(ranks[a]["syncs"][k]["delta"]["sent"] for a in range(actors)) for k in range(len(LRS))]
    headers = sum(16 for a in range(actors) for _ in range(ranks[0]["buckets"]))  # at most one per stripe
    assert full[0] <= delta[0] <= full[0] + headers
    assert 0 < delta[1] <= 0.1 * full[1], (delta, full)
    assert delta[2] <= headers
    assert delta[3] > 0.5 * full[3]
    for r in range(WORLD):
        error = ranks[r]["corrupted"]
        if r == actors + engines - 1:
            assert error.startswith("RlrunError: weight sync: after a delta sync engine rank")
            assert "blocks.1.down.bias" in error and "--weight_sync_delta" in error
        else:
            assert error is None


DEMO_2_1 = ["--config", "configs/demo.yaml", "--max_steps", "6", "--actor_num_gpus_per_node", "2",
            "--vllm_num_engines", "1", "--async_train"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_async_demo_trains_alike_from_many_senders_and_from_the_root(tmp_path):
    """The demo on 2 actor ranks + 1 engine rank generating a step ahead (--async_train): the run says how it syncs,
    and every step's numbers (reward, losses, the engine/actor log-prob gap, the policy lag) equal the root path's on
    the same seed. (The MoE e2e compares a synchronous run, with delta.)"""
    from helpers import run_rlrun, untimed

    many = run_rlrun(3, DEMO_2_1, tmp_path / "many")
    root = run_rlrun(3, DEMO_2_1 + ["--weight_sync_senders", "root"], tmp_path / "root")
    assert many.returncode == 0 and root.returncode == 0, many.output[-3000:] + root.output[-3000:]
    assert "weight sync: many senders: each of the 2 actor ranks sends its own shard" in many.output
    assert "direct" in many.output and "many senders" not in root.output
    assert all(m["async/policy_lag"] == 1.0 for m in many.metrics)
    assert len(many.metrics) == 6 and untimed(many.metrics) == untimed(root.metrics)


if __name__ == "__main__":
    rank, world, port, outdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        for name in LAYOUTS:
            torch.save(scenario(name, rank), outdir / f"rank{rank}.{name}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()
