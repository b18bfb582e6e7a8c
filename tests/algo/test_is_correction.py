"""Engine/actor log-prob mismatch correction (OpenRLHF 0.11.2 PolicyLoss is_correction_*), against
hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rlrun.algo.losses import ISCorrection, check_settings, correction_weights
from rlrun.algo.losses import policy_loss

# One row, three tokens: log(pi_train / pi_rollout) = 0, -1.5, 0.1.
OLD = torch.tensor([[-1.0, -2.0, -0.5]])
ROLLOUT = torch.tensor([[-1.0, -0.5, -0.6]])
MASK = torch.ones(1, 3)
RATIO = [1.0, math.exp(-1.5), math.exp(0.1)]  # 1, 0.22313, 1.10517


def _c(level="token", mode="mask", gating="ratio", low=0.5, high=5.0) -> ISCorrection:
    return ISCorrection(level, mode, gating, low, high)


def test_token_mask_drops_out_of_band_tokens_and_keeps_the_weight_of_the_rest() -> None:
    w, stats = correction_weights(OLD, ROLLOUT, MASK, _c())
    assert torch.allclose(w, torch.tensor([[1.0, 0.0, RATIO[2]]]), atol=1e-6)
    assert float(stats["is_filter_frac"]) == pytest.approx(1 / 3)
    assert float(stats["engine_kl"]) == pytest.approx((0.0 + 1.5 - 0.1) / 3, abs=1e-6)


def test_token_clip_clamps_the_weight() -> None:
    w, stats = correction_weights(OLD, ROLLOUT, MASK, _c(mode="clip"))
    assert torch.allclose(w, torch.tensor([[1.0, 0.5, RATIO[2]]]), atol=1e-6)
    assert float(stats["is_filter_frac"]) == pytest.approx(1 / 3)


def test_sequence_level_gates_on_the_geometric_mean_and_counts_sequences() -> None:
    old = torch.cat([OLD, torch.tensor([[-2.0, -2.0, -9.0]])])
    rollout = torch.cat([ROLLOUT, torch.tensor([[-1.0, -1.0, 0.0]])])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # row 1: mean log ratio -1 over its 2 tokens
    w, stats = correction_weights(old, rollout, mask, _c(level="seq"))
    # row 0: exp(-1.4/3) = 0.627 >= 0.5 kept with its per-token weights; row 1: exp(-1) = 0.368 < 0.5 dropped.
    assert torch.allclose(w[0], torch.tensor(RATIO), atol=1e-6)
    assert torch.equal(w[1], torch.zeros(3))
    assert float(stats["is_filter_frac"]) == pytest.approx(0.5)


@pytest.mark.parametrize("gating, value", [("binary_kl", 0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75)), ("tv", 0.25)])
def test_divergence_gates_are_upper_bounds(gating: str, value: float) -> None:
    old, rollout = torch.tensor([[math.log(0.25)]]), torch.tensor([[math.log(0.5)]])  # q = 0.25, p = 0.5
    mask = torch.ones(1, 1)
    kept, _ = correction_weights(old, rollout, mask, _c(gating=gating, low=0.0, high=value + 1e-3))
    dropped, stats = correction_weights(old, rollout, mask, _c(gating=gating, low=0.0, high=value - 1e-3))
    assert float(kept) == pytest.approx(0.5)  # the survivor keeps pi_train / pi_rollout = 0.25 / 0.5
    assert float(dropped) == 0.0 and float(stats["is_filter_frac"]) == 1.0


def test_policy_loss_multiplies_each_token_loss_by_its_weight() -> None:
    logp = OLD.clone().requires_grad_(True)  # ratio 1 against old
    adv = torch.ones(1, 3)
    loss, stats = policy_loss(logp, OLD, adv, MASK, eps_clip=0.2, rollout_log_probs=ROLLOUT, is_correction=_c())
    # per-token loss -A * ratio = -1, weighted [1, 0, 1.10517], token-mean over 3
    assert float(loss.detach()) == pytest.approx(-(1.0 + RATIO[2]) / 3, abs=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1 / 3, 0.0, -RATIO[2] / 3]]), atol=1e-6)
    assert float(stats["is_filter_frac"]) == pytest.approx(1 / 3)
    off, off_stats = policy_loss(OLD.clone(), OLD, adv, MASK, eps_clip=0.2, rollout_log_probs=ROLLOUT,
                                 is_correction=_c(level="off"))
    assert float(off) == pytest.approx(-1.0) and "is_filter_frac" not in off_stats


def test_gspo_takes_its_sequence_ratio_against_the_rollout() -> None:
    logp = OLD.clone()
    adv = torch.ones(1, 3)
    loss, _ = policy_loss(logp, OLD, adv, MASK, eps_clip=10.0, loss_type="gspo", rollout_log_probs=ROLLOUT,
                          is_correction=_c())
    # sequence ratio exp(mean(logp - rollout)) = exp(-0.4667); loss = -A * ratio (one sequence)
    assert float(loss) == pytest.approx(-math.exp((0.0 - 1.5 + 0.1) / 3), abs=1e-6)


def test_invalid_combinations_are_named() -> None:
    assert "level token" in check_settings(_c(level="seq", mode="clip"))
    assert "upper bound" not in (check_settings(_c(gating="tv", low=0.0, high=0.1)) or "")
    assert "bounded from above" in check_settings(_c(gating="binary_kl"))
    assert check_settings(_c(level="off", mode="clip", gating="tv")) is None
