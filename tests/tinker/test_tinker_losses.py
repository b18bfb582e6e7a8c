"""Tinker's built-in losses (rlrun.tinker.losses) on hand-computed cases: sums over tokens, never means."""

from __future__ import annotations

import math

import pytest
import torch

from rlrun.tinker.losses import LOSSES, LossInputError, check_inputs, loss_config

LOGP = [-1.0, -2.0, -0.5]
SAMPLER = [-1.2, -1.5, -0.5]
ADV = [1.0, -2.0, 0.5]


def _loss(name: str, config: dict[str, float] | None = None, **inputs: list[float]) -> float:
    logp = torch.tensor(LOGP)
    tensors = {k: torch.tensor(v) for k, v in inputs.items()}
    return float(LOSSES[name].fn(logp, tensors, loss_config(name, config)))


def test_cross_entropy_is_the_weighted_sum_of_negative_log_probs() -> None:
    assert _loss("cross_entropy", weights=[0.0, 1.0, 2.0]) == pytest.approx(2.0 + 1.0)
    # the SDK's forward_backward_custom sends signed weights (minus the gradient): still the plain sum
    assert _loss("cross_entropy", weights=[-1.0, 0.5, 0.0]) == pytest.approx(-1.0 + 1.0)


def test_importance_sampling() -> None:
    ratios = [math.exp(a - b) for a, b in zip(LOGP, SAMPLER)]
    expected = -sum(r * a for r, a in zip(ratios, ADV))
    assert _loss("importance_sampling", logprobs=SAMPLER, advantages=ADV) == pytest.approx(expected)
    # optional weights multiply each token's term
    weighted = -sum(r * a * w for r, a, w in zip(ratios, ADV, [1.0, 0.0, 1.0]))
    assert _loss("importance_sampling", logprobs=SAMPLER, advantages=ADV, weights=[1, 0, 1]) == pytest.approx(weighted)


def test_ppo_clips_with_its_defaults_and_the_config() -> None:
    # ratios: e^0.2 = 1.221 (clipped to 1.2 for A > 0), e^-0.5 = 0.607 (A < 0: min keeps the clipped 0.8 * -2), 1
    r = [math.exp(0.2), math.exp(-0.5), 1.0]
    by_hand = -(min(r[0] * 1.0, 1.2 * 1.0) + min(r[1] * -2.0, 0.8 * -2.0) + 0.5)
    assert _loss("ppo", logprobs=SAMPLER, advantages=ADV) == pytest.approx(by_hand)
    wide = -(r[0] * 1.0 + r[1] * -2.0 + 0.5)
    config = {"clip_low_threshold": 0.1, "clip_high_threshold": 10.0}
    assert _loss("ppo", config, logprobs=SAMPLER, advantages=ADV) == pytest.approx(wide)


def test_cispo_weights_log_probs_by_the_clipped_ratio_without_its_gradient() -> None:
    logp = torch.tensor(LOGP, requires_grad=True)
    inputs = {"logprobs": torch.tensor(SAMPLER), "advantages": torch.tensor(ADV)}
    config = loss_config("cispo", {"clip_high_threshold": 1.1})
    loss = LOSSES["cispo"].fn(logp, inputs, config)
    coef = [min(math.exp(a - b), 1.1) for a, b in zip(LOGP, SAMPLER)]
    assert float(loss.detach()) == pytest.approx(-sum(c * lp * a for c, lp, a in zip(coef, LOGP, ADV)))
    loss.backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx([-c * a for c, a in zip(coef, ADV)])


def test_dro_needs_beta_and_adds_the_quadratic_penalty() -> None:
    with pytest.raises(LossInputError, match="beta"):
        loss_config("dro", None)
    beta = 0.1
    expected = -sum(lp * a - 0.5 * beta * (lp - q) ** 2 for lp, q, a in zip(LOGP, SAMPLER, ADV))
    assert _loss("dro", {"beta": beta}, logprobs=SAMPLER, advantages=ADV) == pytest.approx(expected)


def test_gspo_uses_one_sequence_ratio_over_the_masked_tokens() -> None:
    mask = [1.0, 1.0, 0.0]
    s = math.exp(((LOGP[0] - SAMPLER[0]) + (LOGP[1] - SAMPLER[1])) / 2)  # e^-0.15 = 0.861
    by_hand = -sum(min(s * a, min(max(s, 0.8), 1.2) * a) for a in ADV)
    assert _loss("gspo", logprobs=SAMPLER, advantages=ADV, sequence_ratio_mask=mask) == pytest.approx(by_hand)
    logp = torch.tensor(LOGP, requires_grad=True)
    inputs = {k: torch.tensor(v) for k, v in {"logprobs": SAMPLER, "advantages": ADV}.items()}
    LOSSES["gspo"].fn(logp, inputs, loss_config("gspo", None)).backward()
    assert logp.grad is not None  # each token's gradient is the sequence ratio's share: -s * A_t (unclipped tokens)
    s_all = math.exp(sum(a - b for a, b in zip(LOGP, SAMPLER)) / 3)
    assert logp.grad.tolist() == pytest.approx([-s_all * a for a in ADV])


def test_config_and_input_errors_name_the_key() -> None:
    with pytest.raises(LossInputError, match=r"\['beta'\] are not ppo's"):
        loss_config("ppo", {"beta": 1.0})
    with pytest.raises(LossInputError, match=r"needs loss_fn_inputs \['advantages'\]"):
        check_inputs("ppo", {"target_tokens", "logprobs"}, 3, {"target_tokens": 3, "logprobs": 3}, 0)
    with pytest.raises(LossInputError, match=r"\['advantage'\] are not used by importance_sampling"):
        check_inputs("importance_sampling", {"target_tokens", "logprobs", "advantages", "advantage"}, 1, {}, 2)
    with pytest.raises(LossInputError, match=r"datum 4: loss_fn_inputs\['weights'\] has 2 values for 3"):
        check_inputs("cross_entropy", {"target_tokens", "weights"}, 3, {"target_tokens": 3, "weights": 2}, 4)
