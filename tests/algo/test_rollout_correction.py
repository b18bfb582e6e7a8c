"""Rollout correction (rlrun.algo.rollout_correction) under OpenRLHF 0.11.2's --is_correction_* and verl 0.10's
algorithm.rollout_correction, against hand-computed numbers (verl's docs/algo/rollout_corr.md cases among them)."""

from __future__ import annotations

import math

import pytest
import torch

from rlrun.algo.policy_losses import policy_loss
from rlrun.algo.rollout_correction import (
    PREFIX,
    VERL_PRESETS,
    check_openrlhf,
    correct,
    openrlhf_correction,
    parse_is_threshold,
    parse_rejection,
    preset,
    verl_correction,
)

# One row, three tokens: log(pi_train / pi_rollout) = 0, -1.5, 0.1.
OLD = torch.tensor([[-1.0, -2.0, -0.5]])
ROLLOUT = torch.tensor([[-1.0, -0.5, -0.6]])
MASK = torch.ones(1, 3)
RATIO = [1.0, math.exp(-1.5), math.exp(0.1)]  # 1, 0.22313, 1.10517


def _openrlhf(level="token", mode="mask", gating="ratio", low=0.5, high=5.0):
    return openrlhf_correction(level, mode, gating, low, high)


def m(fixed, name: str) -> float:
    return fixed.metrics[PREFIX + name]


# ---- OpenRLHF's gates -------------------------------------------------------------------------------------------


def test_token_mask_drops_out_of_band_tokens_and_keeps_the_weight_of_the_rest() -> None:
    fixed = correct(OLD, ROLLOUT, MASK, _openrlhf())
    assert torch.allclose(fixed.weights, torch.tensor([[1.0, 0.0, RATIO[2]]]), atol=1e-6)
    assert m(fixed, "is_filter_frac") == pytest.approx(1 / 3)
    assert m(fixed, "kl") == pytest.approx((0.0 + 1.5 - 0.1) / 3, abs=1e-6)  # OpenRLHF's vllm_kl
    assert bool(fixed.keep.all())  # gates zero weights; the tokens stay in the loss's denominators


def test_token_clip_clamps_the_weight() -> None:
    fixed = correct(OLD, ROLLOUT, MASK, _openrlhf(mode="clip"))
    assert torch.allclose(fixed.weights, torch.tensor([[1.0, 0.5, RATIO[2]]]), atol=1e-6)
    assert m(fixed, "is_filter_frac") == pytest.approx(1 / 3)


def test_sequence_level_gates_on_the_geometric_mean_and_counts_sequences() -> None:
    old = torch.cat([OLD, torch.tensor([[-2.0, -2.0, -9.0]])])
    rollout = torch.cat([ROLLOUT, torch.tensor([[-1.0, -1.0, 0.0]])])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # row 1: mean log ratio -1 over its 2 tokens
    fixed = correct(old, rollout, mask, _openrlhf(level="seq"))
    # row 0: exp(-1.4/3) = 0.627 >= 0.5 kept with its per-token weights; row 1: exp(-1) = 0.368 < 0.5 dropped.
    assert torch.allclose(fixed.weights[0], torch.tensor(RATIO), atol=1e-6)
    assert torch.equal(fixed.weights[1], torch.zeros(3))
    assert m(fixed, "is_filter_frac") == pytest.approx(0.5)


@pytest.mark.parametrize("gating, value", [("binary_kl", 0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75)), ("tv", 0.25)])
def test_divergence_gates_are_upper_bounds(gating: str, value: float) -> None:
    old, rollout = torch.tensor([[math.log(0.25)]]), torch.tensor([[math.log(0.5)]])  # q = 0.25, p = 0.5
    mask = torch.ones(1, 1)
    kept = correct(old, rollout, mask, _openrlhf(gating=gating, low=0.0, high=value + 1e-3))
    dropped = correct(old, rollout, mask, _openrlhf(gating=gating, low=0.0, high=value - 1e-3))
    assert float(kept.weights) == pytest.approx(0.5)  # the survivor keeps pi_train / pi_rollout = 0.25 / 0.5
    assert float(dropped.weights) == 0.0 and m(dropped, "is_filter_frac") == 1.0


def test_openrlhf_0_11_0_types_as_the_gates() -> None:
    """OpenRLHF 0.10.2-0.11.0's --algo.advantage.is_correction_type on rho = [0.4, 0.8, 6, 1], bounds [0.5, 5]:
    tis clamps, icepop zeroes, seq-mask-tis masks rows by the geometric mean and keeps raw token ratios."""
    rho = torch.tensor([[0.4, 0.8, 6.0, 1.0]])
    old, rollout, mask = rho.log(), torch.zeros(1, 4), torch.ones(1, 4)
    tis = correct(old, rollout, mask, _openrlhf(mode="clip"))
    assert torch.allclose(tis.weights, torch.tensor([[0.5, 0.8, 5.0, 1.0]]))
    icepop = correct(old, rollout, mask, _openrlhf(mode="mask"))
    assert torch.allclose(icepop.weights, torch.tensor([[0.0, 0.8, 0.0, 1.0]]))
    two = torch.tensor([[0.4, 0.8, 6.0, 1.0], [0.2, 0.25, 0.5, 1.0]])
    seq = correct(two.log(), torch.zeros(2, 4), torch.tensor([[1.0] * 4, [1, 1, 1, 0]]), _openrlhf(level="seq"))
    assert torch.allclose(seq.weights, torch.tensor([[0.4, 0.8, 6.0, 1.0], [0.0] * 4]))


def test_openrlhf_rules_are_named() -> None:
    assert "level token" in check_openrlhf("seq", "clip", "ratio", 0.5, 5.0)
    assert check_openrlhf("token", "mask", "tv", 0.0, 0.1) is None
    assert "bounded from above" in check_openrlhf("token", "mask", "binary_kl", 0.5, 5.0)
    assert check_openrlhf("off", "clip", "tv", 0.5, 5.0) is None


def test_policy_loss_multiplies_each_token_loss_by_its_weight() -> None:
    logp = OLD.clone().requires_grad_(True)  # ratio 1 against old
    weights = correct(OLD, ROLLOUT, MASK, _openrlhf()).weights
    loss, _ = policy_loss(logp, OLD, torch.ones(1, 3), MASK, eps_clip=0.2, weights=weights)
    # per-token loss -A * ratio = -1, weighted [1, 0, 1.10517], token-mean over 3
    assert float(loss.detach()) == pytest.approx(-(1.0 + RATIO[2]) / 3, abs=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1 / 3, 0.0, -RATIO[2] / 3]]), atol=1e-6)


# ---- verl's rollout_is / rollout_rs -------------------------------------------------------------------------------

V1_OLD = torch.tensor([[0.25, 0.5, 0.6, 0.8]]).log()  # pi_old
V1_ROLLOUT = torch.tensor([[0.5, 0.5, 0.4, 0.2]]).log()  # mu: rho = [0.5, 1, 1.5, 4]


def test_token_tis_and_its_diagnostics() -> None:
    fixed = correct(V1_OLD, V1_ROLLOUT, torch.ones(1, 4), verl_correction("token", 2.0))
    assert torch.allclose(fixed.weights, torch.tensor([[0.5, 1.0, 1.5, 2.0]]))
    assert m(fixed, "rollout_is_mean") == pytest.approx(1.25)
    assert m(fixed, "rollout_is_ratio_fraction_high") == pytest.approx(0.25)
    assert m(fixed, "rollout_is_ratio_fraction_low") == 0.0
    assert m(fixed, "rollout_is_std") == pytest.approx(math.sqrt(0.3125))
    assert m(fixed, "rollout_is_eff_sample_size") == pytest.approx(1 / 1.2, abs=1e-6)
    assert m(fixed, "kl") == pytest.approx(-math.log(3) / 4)
    assert m(fixed, "k3_kl") == pytest.approx(0.475347, abs=1e-6)
    assert m(fixed, "training_ppl") == pytest.approx(2.020516, abs=1e-5)
    assert m(fixed, "rollout_ppl") == pytest.approx(2.659148, abs=1e-5)
    assert m(fixed, "log_ppl_diff") == pytest.approx(-math.log(3) / 4)
    assert m(fixed, "ppl_ratio") == pytest.approx(3 ** -0.25)
    assert m(fixed, "chi2_token") == pytest.approx(3.875)
    assert m(fixed, "chi2_seq") == pytest.approx(8.0, rel=1e-5)
    normalised = correct(V1_OLD, V1_ROLLOUT, torch.ones(1, 4), verl_correction("token", 2.0, batch_normalize=True))
    assert torch.allclose(normalised.weights, torch.tensor([[0.4, 0.8, 1.2, 1.6]]))
    assert m(normalised, "rollout_is_batch_norm_factor") == pytest.approx(1.25)


def test_sequence_tis_takes_the_product() -> None:
    old = torch.tensor([[0.5, 1.0, 1.5, 4.0], [1.0, 0.8, 1.25, 1.0]]).log()
    mask = torch.tensor([[1.0] * 4, [1, 1, 1, 0]])
    fixed = correct(old, torch.zeros(2, 4), mask, verl_correction("sequence", 2.0))
    assert torch.allclose(fixed.weights, torch.tensor([[2.0] * 4, [1, 1, 1, 0]]))  # products 3 and 1
    assert m(fixed, "rollout_is_mean") == pytest.approx(11 / 7)
    assert m(fixed, "rollout_is_max") == pytest.approx(3.0)
    assert m(fixed, "rollout_is_ratio_fraction_high") == pytest.approx(0.5)
    assert m(fixed, "rollout_is_seq_mean") == pytest.approx(1.5)
    normalised = correct(old, torch.zeros(2, 4), mask, verl_correction("sequence", 2.0, batch_normalize=True))
    assert torch.allclose(normalised.weights[:, 0], torch.tensor([4 / 3, 2 / 3]))


def test_icepop_zeroes_outside_the_band() -> None:
    fixed = correct(torch.tensor([[0.4, 0.8, 6.0]]).log(), torch.zeros(1, 3), torch.ones(1, 3),
                    verl_correction("token", "0.5_5.0"))
    assert torch.allclose(fixed.weights, torch.tensor([[0.0, 0.8, 0.0]]))
    assert m(fixed, "rollout_is_oob_ratio") == pytest.approx(2 / 3)
    assert m(fixed, "rollout_is_eff_sample_size") == pytest.approx(1 / 3, abs=1e-6)


def test_rejection_sampling_masks_sequences_and_tokens() -> None:
    old = torch.tensor([[0.5, 1.0, 1.5, 4.0], [1.0, 0.8, 1.25, 1.0]]).log()
    mask = torch.tensor([[1.0] * 4, [1, 1, 1, 0]])
    geo = correct(old, torch.zeros(2, 4), mask, verl_correction(None, rollout_rs="seq_mean_k1",
                                                                 rollout_rs_threshold="0.8_1.25"))
    assert geo.weights is None
    assert torch.equal(geo.keep[0], torch.zeros(4, dtype=torch.bool)) and bool(geo.keep[1].all())
    assert m(geo, "rollout_rs_masked_fraction") == pytest.approx(4 / 7)
    assert m(geo, "rollout_rs_seq_masked_fraction") == pytest.approx(0.5)
    # seq_max_k2 0.5: row 0's max (ln 4)^2 / 2 = 0.96 is out; seq_mean_k3 0.01 drops row 0 too
    assert correct(old, torch.zeros(2, 4), mask, verl_correction(None, rollout_rs="seq_max_k2",
                                                                 rollout_rs_threshold=0.5)).keep[:, 0].tolist() == [
        False, True]
    # k1's bounds are on log(mu / pi): "0.5_1.5" keeps 1/1.5 <= rho <= 2 (verl's code, not its docs' reading)
    token = correct(torch.tensor([[0.6, 1.8]]).log(), torch.zeros(1, 2), torch.ones(1, 2),
                    verl_correction(None, rollout_rs="token_k1", rollout_rs_threshold="0.5_1.5"))
    assert token.keep.tolist() == [[False, True]]


def test_thresholds_parse_as_verl_writes_them() -> None:
    assert parse_is_threshold(2.0) == (0.0, 2.0, "clamp")
    assert parse_is_threshold("0.5_5.0") == (0.5, 5.0, "zero")
    with pytest.raises(ValueError, match="LOW_HIGH"):
        parse_is_threshold("two")
    with pytest.raises(ValueError, match="LOW <= HIGH"):
        parse_is_threshold("5_0.5")
    rules = parse_rejection("seq_mean_k1,seq_max_k3", "0.999_1.001,0.02")
    assert [(r.name, r.low, r.high) for r in rules] == [("seq_mean_k1", 0.999, 1.001), ("seq_max_k3", None, 0.02)]
    assert parse_rejection("token_k1", 2.0)[0].low == 0.5  # a bare HIGH: LOW = 1 / HIGH
    with pytest.raises(ValueError, match="bounded above only"):
        parse_rejection("token_k2", "0.1_0.2")
    with pytest.raises(ValueError, match="needs rollout_rs_threshold"):
        parse_rejection("token_k2", None)
    with pytest.raises(ValueError, match="rollout_rs option"):
        parse_rejection("sequence", 2.0)


def test_every_verl_preset_builds() -> None:
    assert len(VERL_PRESETS) == 19
    for name in VERL_PRESETS:
        c = preset(name)
        assert c.bypass == name.startswith("bypass") and c.active == (name != "disabled")
    assert preset("bypass_pg_is").bypass_loss == "reinforce" and preset("bypass_pg_is").weights.unit == "sequence"
    assert preset("decoupled_token_icepop").weights.out_of_bounds == "zero"
    assert preset("decoupled_geo_rs").rejection[0].name == "seq_mean_k1"


def test_bypass_reinforce_is_gpg_with_the_weights() -> None:
    """verl's bypass 'reinforce' (-A log pi w): w = min(rho, 2) from the current policy against the engine."""
    logp = torch.tensor([[-1.0, -2.0, -1.0]])
    rollout = logp - torch.tensor([[0.0, math.log(3), -math.log(2)]])
    c = verl_correction("token", 2.0, bypass_mode=True, loss_type="reinforce")
    fixed = correct(logp, rollout, torch.ones(1, 3), c)
    loss, _ = policy_loss(logp, rollout, torch.ones(1, 3), torch.ones(1, 3), eps_clip=0.2, loss_type="gpg",
                          weights=fixed.weights)
    assert float(loss) == pytest.approx(5.5 / 3)
    seq = correct(logp, rollout, torch.ones(1, 3), verl_correction("sequence", 2.0, bypass_mode=True))
    assert torch.allclose(seq.weights, torch.full((1, 3), 1.5))
