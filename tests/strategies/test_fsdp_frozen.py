"""FSDP2's placement of frozen models (reference, reward) on a real 2-rank gloo group: whole on every rank below
ZeRO-3 (as OpenRLHF's ZeRO-0 eval engines; their forwards gather nothing), sharded at ZeRO-3; the same logits
either way. Run as a script (`python test_fsdp_frozen.py RANK WORLD PORT OUTDIR`) it is one rank."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from rlrun.models.tiny import build_causal_lm, tiny_model_config

TOKENS = torch.arange(40, 64).view(4, 6)


def _rank_main(rank: int, world: int, port: int, outdir: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from rlrun.strategies.fsdp import FSDPStrategy

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {}
    for stage in (2, 3):
        strategy = FSDPStrategy(dist.group.WORLD, torch.device("cpu"), bf16=False, zero_stage=stage, offload=False,
                                gradient_checkpointing=False)
        model = strategy.wrap(build_causal_lm(tiny_model_config(), seed=3), trainable=False)
        with torch.no_grad():
            logits = model(input_ids=TOKENS, use_cache=False).logits
        out[stage] = {"sharded": any(isinstance(p, DTensor) for p in model.parameters()),
                      "frozen": not any(p.requires_grad for p in model.parameters()), "logits": logits}
    torch.save(out, outdir / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_frozen_models_are_whole_below_zero3_and_sharded_at_zero3(tmp_path):
    from helpers import run_file_as_ranks  # not at the top: the ranks run this file as __main__

    run_file_as_ranks(__file__, 2, tmp_path, timeout=120)
    with torch.no_grad():
        want = build_causal_lm(tiny_model_config(), seed=3)(input_ids=TOKENS, use_cache=False).logits
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert not res[2]["sharded"] and res[3]["sharded"]
        assert res[2]["frozen"] and res[3]["frozen"]
        for stage in (2, 3):
            torch.testing.assert_close(res[stage]["logits"], want, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
