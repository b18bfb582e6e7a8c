"""The trainable roles' AdamW: fused where the device has the kernel (CPU included), foreach otherwise; the
numbers of a hand-computed step; deterministic; and the same steps on FSDP2 DTensor shards (2 ranks).

Run as a script (`python test_optim.py RANK WORLD PORT OUTDIR`) it is one FSDP2 rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from rlrun.models.tiny import build_causal_lm, tiny_model_config
from rlrun.roles.update import adam_implementation, make_optimizer

TOKENS = torch.arange(4 * 6).view(4, 6) % 250


def test_fused_on_cpu_foreach_elsewhere():
    assert adam_implementation([torch.zeros(3), torch.zeros(2, 2, dtype=torch.bfloat16)]) == {"fused": True}
    assert adam_implementation([torch.zeros(3), torch.zeros(3, device="meta")]) == {"foreach": True}
    assert adam_implementation([]) == {"foreach": True}
    opt = make_optimizer(nn.Linear(2, 2), 1e-3, (0.9, 0.95), 0.0)
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]


def test_one_adamw_step_by_hand():
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, -2.0]]))
    opt = make_optimizer(model, lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)
    model.weight.grad = torch.tensor([[0.5, -0.1]])
    opt.step()
    # Decoupled decay: w * (1 - 0.1 * 0.1) = [0.99, -1.98]. First step: m_hat = g, v_hat = g^2, so the update is
    # lr * g / (|g| + eps) = [0.1, -0.1] (to 1e-8): [0.89, -1.88].
    torch.testing.assert_close(model.weight.detach(), torch.tensor([[0.89, -1.88]]), atol=1e-6, rtol=0)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    opt = make_optimizer(model, 1e-2, (0.9, 0.95), 0.01)
    # A large eps: the key biases' true gradient is 0 (softmax ignores a constant shift), and with the default eps
    # Adam turns their float noise into +-lr steps that differ between any two reduction orders.
    opt.param_groups[0]["eps"] = 1e-4
    return opt


def _train(steps: int) -> list[torch.Tensor]:
    model = build_causal_lm(tiny_model_config(), seed=0)
    opt = _adamw(model)
    for _ in range(steps):
        opt.zero_grad()
        model(input_ids=TOKENS, use_cache=False).logits.float().pow(2).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_deterministic():
    a, b = _train(3), _train(3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    start = build_causal_lm(tiny_model_config(), seed=0)
    assert any(not torch.equal(x, p) for x, p in zip(a, start.parameters()))


# ---- FSDP2 -----------------------------------------------------------------------------------------------------


def _fsdp_rank(rank: int, world: int, port: int, outdir: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from rlrun.strategies.fsdp import FSDPStrategy

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    strategy = FSDPStrategy(dist.group.WORLD, torch.device("cpu"), bf16=False, zero_stage=2, offload=False,
                            gradient_checkpointing=False)
    model = strategy.wrap(build_causal_lm(tiny_model_config(), seed=0))
    opt = _adamw(model)
    assert all(isinstance(p, DTensor) for p in model.parameters()) and opt.defaults["fused"] is True
    mine = TOKENS[rank * 4 // world:(rank + 1) * 4 // world]
    for _ in range(3):  # each rank's mean over its rows; FSDP averages the gradients: the full batch's mean
        opt.zero_grad()
        model(input_ids=mine, use_cache=False).logits.float().pow(2).mean().backward()
        opt.step()
    full = [p.full_tensor() for p in model.parameters()]
    torch.save(full, outdir / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_fused_adamw_on_fsdp2_dtensors(tmp_path):
    world = 2
    from helpers import run_file_as_ranks  # not at the top: the ranks run this file as __main__

    run_file_as_ranks(__file__, world, tmp_path, timeout=200)
    expected = _train(3)  # one process, whole batch, plain tensors
    for r in range(world):
        for got, want in zip(torch.load(tmp_path / f"rank{r}.pt"), expected):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


if __name__ == "__main__":
    _fsdp_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
