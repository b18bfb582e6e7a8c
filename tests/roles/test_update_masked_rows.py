"""Rows whose response mask is all zero (groups removed by --dynamic_filtering) must drop out of the
update exactly, also for the seq-mean loss aggregations: the gradient equals the one computed on the
batch without those rows."""

from __future__ import annotations

import pytest
import torch

from rlrun.algo.losses import aggregate_loss
from rlrun.roles.update import Updater


class _NoClip:
    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), float("inf")))


def _grad_after_one_update(x: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """One Updater step (lr 0, so only the gradient matters) of a per-token linear loss [B, T]."""
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[-1], 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    grads = []

    class _Capture(_NoClip):
        def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
            grads.append(model.weight.grad.clone())
            return super().clip_grad_norm(model, max_norm)

    updater = Updater(model, _Capture(), opt, sched, max_norm=1.0, micro_batch=2, dp_rank=0, dp_size=1)

    def micro_loss(rows: torch.Tensor, num_tokens: float, num_seqs: float):
        per_token = model(x[rows]).squeeze(-1)  # [b, T]
        loss = aggregate_loss(per_token, mask[rows], mode, num_tokens=num_tokens, num_seqs=num_seqs)
        return loss, {}

    updater.run([torch.arange(x.shape[0])], mask, micro_loss)
    return grads[0]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_fully_masked_rows_are_as_if_dropped(mode: str) -> None:
    torch.manual_seed(1)
    x = torch.randn(4, 3, 5)  # [B=4, T=3, features]
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    filtered = mask.clone()
    filtered[1] = 0.0  # row 1 removed by the filter
    filtered[3] = 0.0  # and row 3
    kept = torch.tensor([0, 2])
    with_masked_rows = _grad_after_one_update(x, filtered, mode)
    dropped = _grad_after_one_update(x[kept], mask[kept], mode)
    assert torch.allclose(with_masked_rows, dropped, atol=1e-7), (with_masked_rows, dropped)
    # And it differs from counting the masked rows as sequences (the old divisor) for seq-mean modes.
    if mode != "token-mean":
        assert not torch.allclose(with_masked_rows, dropped * 2 / 4, atol=1e-7)
