"""The LoRA actor as the weight sync's source (rlrun.weight_sync.sources), on real gloo worlds with FSDP2: merged, the
engine receives base + scaling * B @ A under the base model's names, and a sync that delivers nothing fails loudly (the
fault is injected, said in the worker); adapters only, a native engine on a rank of its own keeps its base weights and
takes the adapters alone (no more bytes than they hold), and its logits equal those of an engine given the merged
weights."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from rlrun.config.model import PretrainedConfig
from rlrun.models.loading import load_causal_lm, unfilled_policy
from rlrun.models.lora import LoraSettings, add_adapters

SEED = 42


def test_the_engine_gets_merged_weights_and_a_sync_that_delivers_nothing_fails_loudly(tmp_path) -> None:
    from helpers import run_file_as_ranks

    run_file_as_ranks(__file__, 1, tmp_path, timeout=120)
    assert (tmp_path / "rank0.ok").read_text() == "caught"


def _rank_main(rank: int, world: int, port: int, outdir: Path) -> None:
    """A one-rank colocated sync of a LoRA actor into an engine model whose write is replaced by a no-op: the fault
    (a stand-in for an engine that keeps its old weights, verl issue 7495) must raise, not pass silently."""
    import os

    import torch.distributed as dist

    from rlrun.engines.receivers import KeptModel
    from rlrun.weight_sync.sync import Route, build_weight_sync
    from rlrun.weight_sync.wire import WireFormat
    from rlrun.roles.update import make_optimizer
    from rlrun.runtime.errors import RlrunError
    from rlrun.strategies.fsdp import FSDPStrategy
    from rlrun.weight_sync.sources import MergedFull, MergedLoraParams

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    source = PretrainedConfig(lora_rank=4, lora_alpha=8)
    settings = LoraSettings.of(source)
    strategy = FSDPStrategy(dist.group.WORLD, torch.device("cpu"), bf16=False, zero_stage=2, offload=False,
                            gradient_checkpointing=False)
    actor, _ = strategy.wrap_trainable(add_adapters(unfilled_policy(source, SEED), settings, SEED),
                                       lambda m: make_optimizer(m, 1e-3, (0.9, 0.95), 0.0))
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if ".lora_B." in name:
                p.fill_(0.1)
    engine = load_causal_lm(PretrainedConfig(), SEED)
    params = MergedLoraParams(actor, strategy.param_blocks, settings.scaling)
    sync = build_weight_sync(actor_params=params, receiver=KeptModel(engine), route=Route(colocated=True), wire=WireFormat(bucket_bytes=2 ** 20, dtype=torch.float32), device=torch.device('cpu'), check_names=params.check_names())
    sync.sync()  # delivered: passes
    merged = dict(params.full())
    weights = engine.state_dict()
    assert merged.keys() == dict(engine.named_parameters()).keys()
    assert all(torch.equal(weights[n], t) for n, t in merged.items())
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(weights[q], load_causal_lm(PretrainedConfig(), SEED).state_dict()[q])  # B @ A is in
    MergedFull.write = lambda self, name, dest: dest  # the fault
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if ".lora_B." in name:
                p.fill_(0.2)
    try:
        sync.sync()
        outcome = "passed silently"
    except RlrunError as exc:
        outcome = "caught" if "did not receive" in str(exc) else str(exc)
    (outdir / f"rank{rank}.ok").write_text(outcome)
    dist.destroy_process_group()


def test_a_native_engine_takes_the_adapters_alone_and_decodes_as_with_the_merged_weights(tmp_path) -> None:
    from helpers import run_file_as_ranks

    run_file_as_ranks(__file__, 3, tmp_path, timeout=180)
    got = torch.load(tmp_path / "rank2.pt", weights_only=False)
    root = torch.load(tmp_path / "rank0.pt", weights_only=False)
    actor = root["adapters"]
    assert len(actor) == 2 * 7 * 2 and all(".lora_" in n for n in actor)  # 2 layers x 7 projections x (A, B)
    for k in range(2):
        assert root["sent"][k] <= 1.05 * root["adapter_bytes"]  # the adapters, nothing of the base
        assert got["received"][k] == root["sent"][k]
    assert got["engine_adapters"].keys() == actor.keys()
    assert all(torch.equal(got["engine_adapters"][n], t) for n, t in actor.items())  # exact, after the 2nd sync
    assert not torch.allclose(got["adapter_logits"], got["base_logits"])  # the adapters change what it decodes
    torch.testing.assert_close(got["adapter_logits"], got["merged_logits"], rtol=1e-5, atol=1e-5)


def _adapters_main(rank: int, world: int, port: int, outdir: Path) -> None:
    """Ranks 0-1: a LoRA actor (FSDP2 ZeRO-3, all-linear), trained B; rank 2: two native engines of the base model,
    one taking the adapters (run_adapters), one the merged weights; two syncs each."""
    import os

    import torch.distributed as dist

    from rlrun.engines.native.engine import NativeEngine
    from rlrun.engines.protocol import SamplingSettings
    from rlrun.roles.update import make_optimizer
    from rlrun.strategies.fsdp import FSDPStrategy
    from rlrun.weight_sync.sources import AdapterParams, MergedLoraParams
    from rlrun.weight_sync.sync import Route, build_weight_sync
    from rlrun.weight_sync.wire import WireFormat

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    actor_group, sync_group = dist.new_group([0, 1]), dist.new_group([0, 2])
    source = PretrainedConfig(lora_rank=4, lora_alpha=8)
    settings = LoraSettings.of(source)
    assert settings is not None
    cpu, out = torch.device("cpu"), {}
    adapter_params = merged_params = adapter_engine = merged_engine = None
    if rank < 2:
        strategy = FSDPStrategy(actor_group, cpu, bf16=False, zero_stage=3, offload=False, gradient_checkpointing=False)
        actor, _ = strategy.wrap_trainable(add_adapters(unfilled_policy(source, SEED), settings, SEED),
                                           lambda m: make_optimizer(m, 1e-3, (0.9, 0.95), 0.0))
        adapter_params = AdapterParams(actor, strategy.param_blocks)
        merged_params = MergedLoraParams(actor, strategy.param_blocks, settings.scaling)
    else:
        sampling = SamplingSettings(1.0, 1.0, 4, 0, (1,))
        adapter_engine = NativeEngine(load_causal_lm(PretrainedConfig(), SEED), sampling, cpu)
        adapter_engine.run_adapters(settings.scaling)
        merged_engine = NativeEngine(load_causal_lm(PretrainedConfig(), SEED), sampling, cpu)
    wire = WireFormat(bucket_bytes=2**20, dtype=torch.float32)
    route = Route(root_group=sync_group if rank in (0, 2) else None, actor_ranks=(0, 1))
    syncs = [build_weight_sync(actor_params=params, receiver=engine.weights if engine else None, route=route, wire=wire,
                               device=cpu, check_names=params.check_names() if params else ())
             for params, engine in ((adapter_params, adapter_engine), (merged_params, merged_engine))]
    ids = torch.tensor([[5, 17, 42, 99, 7, 3]])

    def logits(engine) -> torch.Tensor:
        with engine.decoder.weights():
            return engine.decoder.prefill(ids, torch.ones_like(ids, dtype=torch.bool), engine.decoder.new_cache(1, 8))

    if rank == 2:
        out["base_logits"] = logits(adapter_engine)
    out["sent"], out["received"] = [], []
    for step in range(2):
        if rank < 2:
            with torch.no_grad():
                for name, p in actor.named_parameters():
                    if ".lora_B." in name:
                        p.add_(0.05 * (step + 1))
        for sync in syncs:
            sync.sync()
        out["sent"].append(syncs[0].traffic.sent)
        out["received"].append(syncs[0].traffic.received)
    if rank < 2:
        full = dict(adapter_params.full())  # collective over the actor's ranks
        out["adapters"] = full
        out["adapter_bytes"] = sum(t.numel() * 4 for t in full.values())
    else:
        out["engine_adapters"] = {n: p.detach().clone() for n, p in adapter_engine.decoder.adapters.module.named_parameters()}
        out["adapter_logits"], out["merged_logits"] = logits(adapter_engine), logits(merged_engine)
    torch.save(out, outdir / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main = _adapters_main if int(sys.argv[2]) == 3 else _rank_main
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
