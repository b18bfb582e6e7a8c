"""SFT / reward-model / DPO losses against hand-computed numbers (OpenRLHF 0.11.2 models/loss.py semantics)."""

from __future__ import annotations

import math

import pytest
import torch

from rlrun.supervised.losses import (DPOTerms, dpo_loss, nll_term, pair_accuracy, pairwise_rm_loss,
                                     sequence_log_prob, token_nll)


def softplus(x: float) -> float:
    """log(1 + e^x) = -log sigmoid(-x)."""
    return math.log(1.0 + math.exp(x))


# Two pairs of summed response log-probs. Pair 0: h = (-3 - -5) - (-4 - -4.5) = 1.5; pair 1: h = (-1) - (-1) = 0.
PC = [-3.0, -2.0]
PR = [-5.0, -1.0]
RC = [-4.0, -2.5]
RR = [-4.5, -1.5]
BETA = 0.1


def _dpo(**kwargs) -> DPOTerms:
    t = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    return dpo_loss(t(PC), t(PR), t(RC), t(RR), beta=BETA, **kwargs)


def test_sigmoid_dpo_by_hand():
    terms = _dpo(label_smoothing=0.0, ipo=False)
    # -log sigmoid(beta * h) = log(1 + exp(-beta * h)): beta * h = 0.15 and 0.
    expected = [softplus(-0.15), math.log(2.0)]
    assert terms.losses.tolist() == pytest.approx(expected, abs=1e-12)
    assert terms.losses.tolist() == pytest.approx([0.6209570477895321, 0.6931471805599453], abs=1e-12)
    assert terms.losses.shape == (2,)


def test_cdpo_label_smoothing_by_hand():
    terms = _dpo(label_smoothing=0.1, ipo=False)
    # 0.9 * -log sigmoid(0.15) + 0.1 * -log sigmoid(-0.15)
    expected0 = 0.9 * softplus(-0.15) + 0.1 * softplus(0.15)
    assert terms.losses[0].item() == pytest.approx(expected0, abs=1e-12)
    # softplus(x) - softplus(-x) = x, so cDPO = DPO + eps * beta * h.
    assert terms.losses[0].item() == pytest.approx(0.6209570477895321 + 0.1 * 0.15, abs=1e-12)
    assert terms.losses[1].item() == pytest.approx(math.log(2.0), abs=1e-12)  # h = 0: smoothing changes nothing


def test_ipo_by_hand():
    terms = _dpo(label_smoothing=0.3, ipo=True)  # IPO ignores label_smoothing, as OpenRLHF
    # (h - 1 / (2 * beta))^2 with 1 / (2 * 0.1) = 5
    assert terms.losses.tolist() == pytest.approx([(1.5 - 5.0) ** 2, (0.0 - 5.0) ** 2], abs=1e-12)
    assert terms.losses.tolist() == pytest.approx([12.25, 25.0], abs=1e-12)


def test_dpo_implicit_rewards_and_accuracy():
    terms = _dpo(label_smoothing=0.0, ipo=False)
    assert terms.chosen_rewards.tolist() == pytest.approx([0.1 * (-3.0 + 4.0), 0.1 * (-2.0 + 2.5)], abs=1e-12)
    assert terms.rejected_rewards.tolist() == pytest.approx([0.1 * (-5.0 + 4.5), 0.1 * (-1.0 + 1.5)], abs=1e-12)
    # pair 1: 0.05 vs 0.05 is not a win (strictly greater)
    assert pair_accuracy(terms.chosen_rewards, terms.rejected_rewards).tolist() == [1.0, 0.0]


def test_dpo_gradients_point_the_right_way():
    pc = torch.tensor(PC, dtype=torch.float64, requires_grad=True)
    pr = torch.tensor(PR, dtype=torch.float64, requires_grad=True)
    terms = dpo_loss(pc, pr, torch.tensor(RC, dtype=torch.float64), torch.tensor(RR, dtype=torch.float64),
                     beta=BETA, label_smoothing=0.0, ipo=False)
    terms.losses.sum().backward()
    # d/d pc of -log sigmoid(beta h) = -beta * sigmoid(-beta h); the rejected side gets the opposite sign.
    assert pc.grad.tolist() == pytest.approx([-0.1 / (1 + math.exp(0.15)), -0.1 * 0.5], abs=1e-12)
    assert pc.grad[0].item() == pytest.approx(-0.04625701546562505, abs=1e-12)
    assert pr.grad.tolist() == pytest.approx((-pc.grad).tolist(), abs=1e-12)
    assert not terms.chosen_rewards.requires_grad and not terms.rejected_rewards.requires_grad


def test_ipo_gradient_by_hand():
    pc = torch.tensor(PC, dtype=torch.float64, requires_grad=True)
    terms = dpo_loss(pc, torch.tensor(PR, dtype=torch.float64), torch.tensor(RC, dtype=torch.float64),
                     torch.tensor(RR, dtype=torch.float64), beta=BETA, label_smoothing=0.0, ipo=True)
    terms.losses.sum().backward()
    assert pc.grad.tolist() == pytest.approx([2 * (1.5 - 5.0), 2 * (0.0 - 5.0)], abs=1e-12)  # [-7, -10]


def test_cdpo_pushes_back_on_a_confident_pair():
    """With label smoothing the loss has a minimum at finite h: its gradient turns positive for a large margin."""
    # h = 100: d/d pc = -0.1 * (0.9 * sigmoid(-10) - 0.1 * sigmoid(10)) > 0
    pc = torch.tensor([0.0], dtype=torch.float64, requires_grad=True)
    terms = dpo_loss(pc, torch.tensor([-100.0], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64),
                     torch.tensor([0.0], dtype=torch.float64), beta=0.1, label_smoothing=0.1, ipo=False)
    terms.losses.sum().backward()
    s = 1 / (1 + math.exp(10.0))  # sigmoid(-10)
    assert pc.grad.item() == pytest.approx(-0.1 * (0.9 * s - 0.1 * (1 - s)), abs=1e-12)
    assert pc.grad.item() > 0


def test_dpo_rejects_bad_shapes_and_beta():
    one = torch.zeros(3)
    with pytest.raises(ValueError, match="shapes"):
        dpo_loss(one, one, one, torch.zeros(2), beta=0.1, label_smoothing=0.0, ipo=False)
    with pytest.raises(ValueError, match="shapes"):
        dpo_loss(torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2, 1), torch.zeros(2, 1), beta=0.1,
                 label_smoothing=0.0, ipo=False)
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(one, one, one, one, beta=0.0, label_smoothing=0.0, ipo=True)


# Per-token log-probs [B=3, R=4] and response masks (row 2 has no response token).
LOGP = torch.tensor([[-1.0, -2.0, -3.0, -9.0],
                     [-0.5, -1.5, -7.0, -7.0],
                     [-4.0, -4.0, -4.0, -4.0]], dtype=torch.float64)
MASK = torch.tensor([[0, 1, 1, 0],
                     [1, 1, 0, 0],
                     [0, 0, 0, 0]])


def test_sequence_log_prob_and_token_nll_by_hand():
    assert sequence_log_prob(LOGP, MASK).tolist() == [-5.0, -2.0, 0.0]
    assert token_nll(LOGP, MASK).tolist() == [5.0, 2.0, 0.0]
    assert token_nll(LOGP, MASK.bool()).tolist() == [5.0, 2.0, 0.0]


def test_nll_term_is_a_per_sequence_token_mean():
    # (2 + 3) / 2 and (0.5 + 1.5) / 2; an empty response counts 0 (OpenRLHF: 0/0 = NaN, never reached there)
    assert nll_term(LOGP, MASK).tolist() == [2.5, 1.0, 0.0]


def test_nll_term_global_mean_equals_openrlhf_micro_batch_means():
    """OpenRLHF: -mean(seq means) per micro-batch, DeepSpeed averages the micro-batches; rlrun: sum / global pairs."""
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.25, -4.0], [-2.0, -2.0, -2.0], [-1.0, -3.0, -6.0]],
                        dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 1], [1, 0, 0]])
    # per-sequence means: 2, 0.375, 2, 1
    openrlhf = (nll_term(logp[:2], mask[:2]).mean() + nll_term(logp[2:], mask[2:]).mean()) / 2
    rlrun = nll_term(logp, mask).sum() / 4
    assert rlrun.item() == pytest.approx((2.0 + 0.375 + 2.0 + 1.0) / 4, abs=1e-12)
    assert rlrun.item() == pytest.approx(openrlhf.item(), abs=1e-12)
    # NOT a token mean over all chosen tokens: that would be (6 + 0.75 + 2 + 1) / 7
    assert rlrun.item() != pytest.approx(9.75 / 7)


def test_sft_global_token_normalisation_equals_full_batch():
    """Two micro-batches with different token counts: sum / global tokens == the full batch's token mean."""
    full = token_nll(LOGP, MASK).sum() / MASK.sum()
    parts = (token_nll(LOGP[:1], MASK[:1]).sum() + token_nll(LOGP[1:], MASK[1:]).sum()) / MASK.sum()
    assert full.item() == pytest.approx((5.0 + 2.0) / 4, abs=1e-12)
    assert parts.item() == pytest.approx(full.item(), abs=1e-12)


def test_token_losses_reject_bad_shapes():
    with pytest.raises(ValueError, match=r"\[B, R\]"):
        token_nll(LOGP, MASK[:, :3])
    with pytest.raises(ValueError, match=r"\[B, R\]"):
        nll_term(LOGP[0], MASK[0])


CHOSEN = [1.0, 0.0, -2.0]
REJECTED = [0.0, 0.0, 1.0]


def test_pairwise_sigmoid_by_hand():
    loss = pairwise_rm_loss(torch.tensor(CHOSEN), torch.tensor(REJECTED), kind="sigmoid")
    # -log sigmoid(chosen - rejected) with differences 1, 0, -3
    assert loss.tolist() == pytest.approx([softplus(-1.0), math.log(2.0), softplus(3.0)], abs=1e-6)
    assert loss.tolist() == pytest.approx([0.31326168751822286, 0.6931471805599453, 3.048587351573742], abs=1e-6)


def test_pairwise_sigmoid_with_margin_by_hand():
    margin = torch.tensor([0.5, -1.0, 0.0])
    loss = pairwise_rm_loss(torch.tensor(CHOSEN), torch.tensor(REJECTED), kind="sigmoid", margin=margin)
    # -log sigmoid(chosen - rejected - margin): 1 - 0.5, 0 + 1, -3 - 0
    assert loss.tolist() == pytest.approx([softplus(-0.5), softplus(-1.0), softplus(3.0)], abs=1e-6)
    assert loss[0].item() == pytest.approx(0.4740769841801067, abs=1e-6)


def test_logexp_by_hand_and_margin_ignored():
    c, r = torch.tensor(CHOSEN), torch.tensor(REJECTED)
    loss = pairwise_rm_loss(c, r, kind="logexpsigmoid")
    # log(1 + exp(rejected - chosen))
    assert loss.tolist() == pytest.approx([softplus(-1.0), softplus(0.0), softplus(3.0)], abs=1e-6)
    # OpenRLHF's LogExpLoss takes a margin and does not use it
    with_margin = pairwise_rm_loss(c, r, kind="logexpsigmoid", margin=torch.tensor([5.0, 5.0, 5.0]))
    assert with_margin.tolist() == loss.tolist()


def test_logexp_stays_finite_where_a_literal_exp_overflows():
    loss = pairwise_rm_loss(torch.tensor([-100.0]), torch.tensor([100.0]), kind="logexpsigmoid")
    assert loss.item() == pytest.approx(200.0)  # log(1 + e^200) ~ 200; OpenRLHF's literal form gives inf in fp32


@pytest.mark.parametrize("kind", ["sigmoid", "logexpsigmoid"])
def test_rm_gradient_raises_chosen_lowers_rejected(kind):
    c = torch.tensor([0.5, -1.0], requires_grad=True)
    r = torch.tensor([0.0, 2.0], requires_grad=True)
    pairwise_rm_loss(c, r, kind=kind).sum().backward()
    assert (c.grad < 0).all() and (r.grad > 0).all()
    # d/dc -log sigmoid(c - r) = -sigmoid(r - c)
    assert c.grad.tolist() == pytest.approx([-1 / (1 + math.exp(0.5)), -1 / (1 + math.exp(-3.0))], abs=1e-6)


def test_rm_loss_rejects_unknown_kind_and_shapes():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="unknown reward-model loss 'hinge'"):
        pairwise_rm_loss(x, x, kind="hinge")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shapes"):
        pairwise_rm_loss(x, torch.zeros(3), kind="sigmoid")
    with pytest.raises(ValueError, match="shapes"):
        pairwise_rm_loss(x, x, kind="sigmoid", margin=torch.zeros(3))
