"""The LoRA actor as the weight sync's source (strategies/lora_params.py), on a real one-rank gloo world with FSDP2:
the engine receives base + scaling * B @ A under the base model's names, and a sync that delivers nothing fails
loudly (the fault is injected, said in the worker)."""

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


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
