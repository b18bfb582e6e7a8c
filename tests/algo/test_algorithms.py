"""Hand-checked tests for rlrun.algo.algorithms and rlrun.algo.losses.

Expected numbers are worked out in the comments, not by re-running the formula.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from rlrun.algo.algorithms import (
    ADVANTAGE_ESTIMATORS,
    GROUP_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLControllerState,
    compute_advantages,
    compute_approx_kl,
    compute_gae,
    discounted_returns,
    make_kl_controller,
    masked_mean,
    masked_whiten,
    shape_group_scores,
    token_level_rewards,
)
from rlrun.algo.losses import aggregate_loss, entropy_from_logits, log_probs_from_logits, value_loss
from rlrun.algo.policy_losses import policy_loss


def t(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# ---------------------------------------------------------------- basics


def test_estimator_sets() -> None:
    assert ADVANTAGE_ESTIMATORS == (
        "gae", "group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline")
    assert GROUP_ESTIMATORS == frozenset(ADVANTAGE_ESTIMATORS) - {"gae"}


def test_masked_mean_and_whiten() -> None:
    x = t([[1.0, 2.0, float("nan")], [3.0, 100.0, 100.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # (1 + 2 + 3) / 3 = 2; the NaN under the mask must not leak
    assert_close(masked_mean(x, mask), t(2.0))
    # per row: [1.5, 3]
    assert_close(masked_mean(x, mask, dim=1), t([1.5, 3.0]))
    assert_close(masked_mean(x, torch.zeros_like(mask)), t(0.0))
    # values 1,2,3: mean 2, biased var (1+0+1)/3 = 2/3 -> std sqrt(2/3)
    w = masked_whiten(x, mask)
    s = math.sqrt(2 / 3)
    assert_close(w, t([[-1 / s, 0.0, 0.0], [1 / s, 0.0, 0.0]]))
    # shift_mean=False keeps mean 2: [2 - 1/s, 2, 2 + 1/s]
    w2 = masked_whiten(x, mask, shift_mean=False)
    assert_close(w2, t([[2 - 1 / s, 2.0, 0.0], [2 + 1 / s, 0.0, 0.0]]))


# ---------------------------------------------------------------- KL


def test_kl_estimators_by_hand() -> None:
    logp = t([[-1.0, -2.0, -0.5, -100.0]])
    ref = t([[-1.5, -1.0, -0.5, 0.0]])
    mask = t([[1, 1, 1, 0]])
    # logp - ref = [0.5, -1.0, 0.0, (masked)]
    assert_close(compute_approx_kl(logp, ref, "k1", mask), t([[0.5, -1.0, 0.0, 0.0]]))
    # 0.5 * [0.25, 1.0, 0]
    assert_close(compute_approx_kl(logp, ref, "k2", mask), t([[0.125, 0.5, 0.0, 0.0]]))
    # ref - logp = [-0.5, 1.0, 0]; exp(-0.5) + 0.5 - 1 = 0.1065306597, e - 1 - 1 = 0.7182818285
    k3 = compute_approx_kl(logp, ref, "k3", mask)
    assert_close(k3, t([[0.1065306597, 0.7182818285, 0.0, 0.0]]))
    # without a mask the last (huge) term is finite thanks to the clamp
    assert torch.isfinite(compute_approx_kl(logp.float(), ref.float(), "k3")).all()
    with pytest.raises(ValueError, match="k4"):
        compute_approx_kl(logp, ref, "k4", mask)  # type: ignore[arg-type]


# ---------------------------------------------------------------- GAE / returns


def test_compute_gae_by_hand() -> None:
    gamma, lambd = 0.9, 0.8  # gamma * lambd = 0.72
    rewards = t([[0.0, 0.0, 1.0, 5.0], [0.5, -1.0, 3.0, 3.0]])
    values = t([[0.5, 0.4, 0.2, 9.0], [1.0, 0.0, 7.0, 7.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma, lambd)
    # row 0 (last response token t=2, bootstrap 0):
    #   t2: delta = 1 + 0 - 0.2 = 0.8                          A = 0.8
    #   t1: delta = 0 + 0.9*0.2 - 0.4 = -0.22                  A = -0.22 + 0.72*0.8 = 0.356
    #   t0: delta = 0 + 0.9*0.4 - 0.5 = -0.14                  A = -0.14 + 0.72*0.356 = 0.11632
    # row 1 (last token t=1):
    #   t1: delta = -1 + 0 - 0 = -1                            A = -1
    #   t0: delta = 0.5 + 0.9*0 - 1.0 = -0.5                   A = -0.5 + 0.72*(-1) = -1.22
    assert_close(adv, t([[0.11632, 0.356, 0.8, 0.0], [-1.22, -1.0, 0.0, 0.0]]))
    # returns = A + V: [0.61632, 0.756, 1.0], [-0.22, -1.0]
    assert_close(ret, t([[0.61632, 0.756, 1.0, 0.0], [-0.22, -1.0, 0.0, 0.0]]))


def test_discounted_returns_by_hand() -> None:
    rewards = t([[1.0, 2.0, 4.0, 8.0], [1.0, 1.0, 1.0, 1.0]])
    mask = t([[1, 1, 1, 0], [0, 0, 0, 0]])
    # gamma 0.5: t2 = 4; t1 = 2 + 0.5*4 = 4; t0 = 1 + 0.5*4 = 3; the masked 8 is ignored
    expect = t([[3.0, 4.0, 4.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert_close(discounted_returns(rewards, mask, 0.5), expect)


def test_token_level_rewards_by_hand() -> None:
    scores = t([2.0, -3.0, 5.0])
    kl = t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [1.0, 1.0, 1.0]])
    mask = t([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    # -0.5*kl: row0 [-0.05, -0.1, (masked)], row1 [-0.2, -0.25, -0.3]; row2 empty -> zeros
    # row0 last token is t=1: -0.1 + 2 = 1.9 ; row1 last token t=2: -0.3 - 3 = -3.3
    out = token_level_rewards(scores, kl, mask, 0.5)
    assert_close(out, t([[-0.05, 1.9, 0.0], [-0.2, -0.25, -3.3], [0.0, 0.0, 0.0]]))
    # clip to [-2, 2]: -3 -> -2, so row1 last = -0.3 - 2 = -2.3 ; 2 stays 2
    out = token_level_rewards(scores, kl, mask, 0.5, reward_clip_range=(-2.0, 2.0))
    assert_close(out, t([[-0.05, 1.9, 0.0], [-0.2, -0.25, -2.3], [0.0, 0.0, 0.0]]))
    # no KL: score only
    out = token_level_rewards(scores, None, mask, 0.5)
    assert_close(out, t([[0.0, 2.0, 0.0], [0.0, 0.0, -3.0], [0.0, 0.0, 0.0]]))


# ---------------------------------------------------------------- group shaping

SCORES = [1.0, 2.0, 6.0, 0.0, 0.0, 3.0]  # two groups of 3: mean 3 (sum 9), mean 1 (sum 3)


def test_shape_group_scores_by_hand() -> None:
    s = t(SCORES)
    # r - mean: [1-3, 2-3, 6-3, 0-1, 0-1, 3-1]
    centred = t([-2.0, -1.0, 3.0, -1.0, -1.0, 2.0])
    assert_close(shape_group_scores(s, 3, "dr_grpo"), centred)
    assert_close(shape_group_scores(s, 3, "reinforce_baseline"), centred)
    # leave-one-out: 1 - (2+6)/2 = -3 ; 2 - (1+6)/2 = -1.5 ; 6 - (1+2)/2 = 4.5
    #                0 - (0+3)/2 = -1.5 ; same ; 3 - (0+0)/2 = 3
    assert_close(shape_group_scores(s, 3, "rloo"), t([-3.0, -1.5, 4.5, -1.5, -1.5, 3.0]))
    # unbiased std: group1 devs [-2,-1,3] -> (4+1+9)/2 = 7 ; group2 devs [-1,-1,2] -> (1+1+4)/2 = 3
    # OpenRLHF's epsilon: std + 1e-9
    s7, s3 = math.sqrt(7) + 1e-9, math.sqrt(3) + 1e-9
    expect = t([-2 / s7, -1 / s7, 3 / s7, -1 / s3, -1 / s3, 2 / s3])
    assert_close(shape_group_scores(s, 3, "group_norm"), expect)
    # identical scores in a group -> 0, not NaN
    assert_close(shape_group_scores(t([5.0, 5.0]), 2, "group_norm"), t([0.0, 0.0]))
    assert_close(shape_group_scores(s, 3, "reinforce"), s)
    assert_close(shape_group_scores(s, 3, "gae"), s)
    assert_close(shape_group_scores(s, 1, "reinforce"), s)


@pytest.mark.parametrize("est", ["group_norm", "dr_grpo", "rloo", "reinforce_baseline"])
def test_shape_group_scores_needs_groups(est: str) -> None:
    with pytest.raises(ValueError, match="n_samples_per_prompt > 1"):
        shape_group_scores(t(SCORES), 1, est)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"B=5.*n_samples_per_prompt=2"):
        shape_group_scores(t([1.0, 2.0, 3.0, 4.0, 5.0]), 2, est)  # type: ignore[arg-type]


# ---------------------------------------------------------------- compute_advantages


def _biased_masked_std(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    v = x[mask.bool()]
    return ((v - v.mean()) ** 2).mean().sqrt()


def test_advantages_gae() -> None:
    scores = t([1.0])
    mask = t([[1, 1, 0]])
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", scores, mask, n_samples_per_prompt=1)
    values = t([[0.5, 0.0, 3.0]])
    adv, ret = compute_advantages("gae", scores, mask, n_samples_per_prompt=1, values=values)
    # rewards [0, 1, -]; gamma=lambda=1:
    # t1: delta = 1 - 0 = 1 -> A=1 ; t0: delta = 0 + 0 - 0.5 = -0.5 -> A = 0.5 ; returns [1, 1]
    assert_close(ret, t([[1.0, 1.0, 0.0]]))
    # whiten [0.5, 1]: mean 0.75, biased std 0.25 -> [-1, 1]
    assert_close(adv, t([[-1.0, 1.0, 0.0]]), atol=1e-6, rtol=0)


def test_advantages_rloo_with_kl_by_hand() -> None:
    scores = t([1.0, 3.0])
    mask = t([[1, 1], [1, 0]])
    kl = t([[0.2, 0.4], [1.0, 9.0]])
    adv, ret = compute_advantages("rloo", scores, mask, n_samples_per_prompt=2, kl=kl, kl_coef=0.5)
    # rloo: 1 - 3 = -2, 3 - 1 = 2
    # row0 token rewards [-0.1, -0.2 - 2] = [-0.1, -2.2] -> returns [-2.3, -2.2]
    # row1 token rewards [-0.5 + 2, -]    = [1.5]        -> returns [1.5, 0]
    assert_close(ret, t([[-2.3, -2.2], [1.5, 0.0]]))
    assert_close(adv, ret)  # rloo is not whitened


def test_advantages_dr_grpo_and_kl_none() -> None:
    scores = t(SCORES)
    mask = t([[1, 1, 0]] * 6)
    adv, ret = compute_advantages("dr_grpo", scores, mask, n_samples_per_prompt=3)
    # gamma=1, no KL: every response token carries r - mean_g
    expect = t([-2.0, -1.0, 3.0, -1.0, -1.0, 2.0])[:, None] * mask
    assert_close(adv, expect)
    assert_close(ret, expect)
    zeros = torch.zeros(6, 3, dtype=torch.float64)
    adv0, _ = compute_advantages("dr_grpo", scores, mask, n_samples_per_prompt=3, kl=zeros, kl_coef=0.1)
    assert_close(adv0, adv)


def test_advantages_group_norm_zero_mean_per_group() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(8, generator=g, dtype=torch.float64)
    mask = t([[1, 1, 1, 0]] * 8)
    adv, ret = compute_advantages("group_norm", scores, mask, n_samples_per_prompt=4)
    per_seq = adv[:, 0].reshape(2, 4)
    assert_close(per_seq.mean(-1), t([0.0, 0.0]), atol=1e-12, rtol=0)
    assert_close(per_seq.std(-1), t([1.0, 1.0]), atol=1e-5, rtol=0)
    assert_close(adv, ret)


@pytest.mark.parametrize("est", ["reinforce", "reinforce_baseline"])
def test_advantages_reinforce_whitened(est: str) -> None:
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(6, generator=g, dtype=torch.float64) * 3 + 2
    kl = torch.rand(6, 5, generator=g, dtype=torch.float64)
    lengths = [5, 2, 4, 1, 3, 5]
    mask = t([[1.0 if j < n else 0.0 for j in range(5)] for n in lengths])
    adv, ret = compute_advantages(
        est, scores, mask, n_samples_per_prompt=2, kl=kl, kl_coef=0.1, gamma=0.95)  # type: ignore[arg-type]
    assert_close(masked_mean(adv, mask), t(0.0), atol=1e-10, rtol=0)
    assert_close(_biased_masked_std(adv, mask), t(1.0), atol=1e-6, rtol=0)
    assert (adv[mask == 0] == 0).all() and (ret[mask == 0] == 0).all()
    shaped = shape_group_scores(scores, 2, est)  # type: ignore[arg-type]
    # reinforce keeps --gamma; reinforce_baseline runs with gamma = 1 (as OpenRLHF forces)
    gamma = 0.95 if est == "reinforce" else 1.0
    assert_close(ret, discounted_returns(token_level_rewards(shaped, kl, mask, 0.1), mask, gamma))


# ---------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_arithmetic_and_resume() -> None:
    c = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # 9/6 - 1 = 0.5 -> clipped to 0.2 ; mult = 1 + 0.2 * 1000/10000 = 1.02 -> 0.102
    c.update(9.0, 1000)
    assert c.value == pytest.approx(0.102)
    # 5.4/6 - 1 = -0.1 ; mult = 1 - 0.1 * 500/10000 = 0.995 -> 0.102 * 0.995 = 0.10149
    c.update(5.4, 500)
    assert c.value == pytest.approx(0.10149)
    st = c.state()
    assert isinstance(st, KLControllerState)
    d = make_kl_controller(0.5, 6.0, 10000)
    assert isinstance(d, AdaptiveKLController)
    d.load_state(st)
    assert d.value == c.value
    for ctrl in (c, d):
        ctrl.update(3.0, 256)
    assert d.value == c.value
    d.load_state({"value": 0.25})
    assert d.value == 0.25


def test_fixed_kl_controller() -> None:
    c = make_kl_controller(0.05, None, 10000)
    assert isinstance(c, FixedKLController)
    c.update(100.0, 1000)
    assert c.value == 0.05
    c.load_state(KLControllerState(value=0.07))
    assert c.state() == KLControllerState(value=0.07)


# ---------------------------------------------------------------- losses


def test_aggregate_loss_by_hand() -> None:
    loss = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # kept: row0 {1,2}, row1 {4}
    assert_close(aggregate_loss(loss, mask, "token-mean"), t(7 / 3))  # (1+2+4)/3
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum"), t(3.5))  # (3 + 4)/2
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-mean"), t(2.75))  # (1.5 + 4)/2
    # global denominators
    assert_close(aggregate_loss(loss, mask, "token-mean", num_tokens=7), t(1.0))  # 7/7
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-sum", num_seqs=4), t(1.75))  # 7/4
    assert_close(aggregate_loss(loss, mask, "seq-mean-token-mean", num_seqs=4), t(1.375))  # 5.5/4
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        empty = aggregate_loss(loss, torch.zeros_like(mask), mode)  # type: ignore[arg-type]
        assert_close(empty, t(0.0))
    with pytest.raises(ValueError):
        aggregate_loss(loss, mask, "sum")  # type: ignore[arg-type]


def test_policy_loss_clipping_by_hand() -> None:
    ratio = t([[1.5, 0.5, 1.1, 7.0]])
    adv = t([[1.0, -1.0, 2.0, 5.0]])
    mask = t([[1, 1, 1, 0]])
    logp = ratio.log().requires_grad_()
    old = torch.zeros_like(ratio)
    loss, stats = policy_loss(logp, old, adv, mask, eps_clip=0.2)
    # t0: r=1.5, A=1 : max(-1.5, -1.2) = -1.2 (clipped)
    # t1: r=0.5, A=-1: max(0.5, 0.8)   = 0.8  (clipped)
    # t2: r=1.1, A=2 : max(-2.2, -2.2) = -2.2 (inside the range)
    # token-mean = (-1.2 + 0.8 - 2.2)/3 = -0.8666667
    assert_close(loss, t(-2.6 / 3))
    assert_close(stats["clip_frac"], t(2 / 3))
    assert_close(stats["ratio"], t(3.1 / 3))  # (1.5 + 0.5 + 1.1)/3
    # mean(old - new) = (-ln1.5 - ln0.5 - ln1.1)/3 = 0.0641239642
    assert_close(stats["approx_kl"], t(0.0641239642))
    assert not any(v.requires_grad for v in stats.values())
    loss.backward()
    # only the unclipped token t2 has gradient: d/dlogp (-A r)/3 = -2*1.1/3
    assert logp.grad is not None
    assert_close(logp.grad, t([[0.0, 0.0, -2.2 / 3, 0.0]]))


def test_policy_loss_dual_clip_by_hand() -> None:
    ratio = t([[3.0, 3.0, 1.5]])
    adv = t([[-1.0, 1.0, -1.0]])
    mask = t([[1, 1, 1]])
    logp = ratio.log().requires_grad_()
    old = torch.zeros_like(ratio)
    # no dual clip:
    # t0: r=3, A=-1: max(3, 1.2) = 3 ; t1: r=3, A=1: max(-3, -1.2) = -1.2
    # t2: r=1.5, A=-1: max(1.5, 1.2) = 1.5
    loss, _ = policy_loss(logp, old, adv, mask, eps_clip=0.2)
    assert_close(loss, t((3.0 - 1.2 + 1.5) / 3))
    # dual clip 2: A<0 losses capped at -A*2 = 2 -> t0: 3 -> 2 ; t2: 1.5 stays ; t1 (A>0) untouched
    loss, stats = policy_loss(logp, old, adv, mask, eps_clip=0.2, dual_clip=2.0)
    assert_close(loss, t((2.0 - 1.2 + 1.5) / 3))
    assert_close(stats["dual_clip_frac"], t(1 / 3))
    loss.backward()
    # t0 capped -> constant -> no grad ; t1 clipped -> no grad ; t2: d(-A r)/dlogp / 3 = 1.5/3
    assert logp.grad is not None
    assert_close(logp.grad, t([[0.0, 0.0, 0.5]]))
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(logp, old, adv, mask, eps_clip=0.2, dual_clip=1.0)


def test_value_loss_by_hand() -> None:
    values = t([[1.0, 2.0, 3.0, 50.0]])
    old = t([[0.5, 2.5, 2.0, 0.0]])
    returns = t([[2.0, 1.0, 2.5, 0.0]])
    mask = t([[1, 1, 1, 0]])
    loss, stats = value_loss(values, old, returns, mask, value_clip=None)
    # 0.5 * [(-1)^2, 1^2, 0.5^2] = [0.5, 0.5, 0.125] -> mean 1.125/3 = 0.375
    assert_close(loss, t(0.375))
    assert_close(stats["value_clip_frac"], t(0.0))
    loss, stats = value_loss(values, old, returns, mask, value_clip=0.2)
    # t0: clipped v = 0.5 + 0.2 = 0.7 -> (0.7-2)^2 = 1.69 > 1  -> 0.845 (clipped)
    # t1: clipped v = 2.5 - 0.2 = 2.3 -> (2.3-1)^2 = 1.69 > 1  -> 0.845 (clipped)
    # t2: clipped v = 2.0 + 0.2 = 2.2 -> (2.2-2.5)^2 = 0.09 < 0.25 -> 0.125
    # mean = 1.815/3 = 0.605
    assert_close(loss, t(0.605))
    assert_close(stats["value_clip_frac"], t(2 / 3))


# ---------------------------------------------------------------- micro-batch == full batch


def _setup_microbatch_problem() -> tuple[torch.nn.Linear, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    b, seq, d, vocab = 4, 5, 3, 7
    lin = torch.nn.Linear(d, vocab).double()
    x = torch.randn(b, seq, d, dtype=torch.float64)
    labels = torch.randint(0, vocab, (b, seq))
    lengths = [5, 3, 1, 4]  # micro-batches of 2 hold 8 and 5 tokens: unequal on purpose
    mask = t([[1.0 if j < n else 0.0 for j in range(seq)] for n in lengths])
    with torch.no_grad():
        old = log_probs_from_logits(lin(x), labels) + 0.3 * torch.randn(b, seq, dtype=torch.float64)
    adv = torch.randn(b, seq, dtype=torch.float64)
    return lin, {"x": x, "labels": labels, "mask": mask, "old": old, "adv": adv}


def _grads(
    lin: torch.nn.Linear, data: dict[str, torch.Tensor], mode: str, micro: int, use_global: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    lin.zero_grad()
    b = data["x"].size(0)
    total = torch.zeros((), dtype=torch.float64)
    n_micro = b // micro
    for i in range(0, b, micro):
        sl = slice(i, i + micro)
        logp = log_probs_from_logits(lin(data["x"][sl]), data["labels"][sl])
        kwargs = {}
        if use_global:
            kwargs = {"num_tokens": float(data["mask"].sum()), "num_seqs": float(b)}
        loss, _ = policy_loss(logp, data["old"][sl], data["adv"][sl], data["mask"][sl],
                              eps_clip=0.2, agg=mode, **kwargs)  # type: ignore[arg-type]
        if not use_global:
            loss = loss / n_micro  # the naive "average of micro-batch means"
        loss.backward()
        total = total + loss.detach()
    return total, [p.grad.clone() for p in lin.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_microbatch_gradients_match_full_batch(mode: str) -> None:
    lin, data = _setup_microbatch_problem()
    full_loss, full_grads = _grads(lin, data, mode, micro=4, use_global=False)
    assert any(g.abs().sum() > 0 for g in full_grads)
    for micro in (2, 1):
        loss, grads = _grads(lin, data, mode, micro=micro, use_global=True)
        assert_close(loss, full_loss)
        for g, fg in zip(grads, full_grads):
            assert_close(g, fg)
    if mode == "token-mean":
        # Averaging per-micro-batch token means weights tokens of short micro-batches up:
        # this must NOT match, otherwise the test above could not detect the bug.
        naive_loss, naive_grads = _grads(lin, data, mode, micro=2, use_global=False)
        with pytest.raises(AssertionError):
            assert_close(naive_loss, full_loss)
        with pytest.raises(AssertionError):
            for g, fg in zip(naive_grads, full_grads):
                assert_close(g, fg)


# ---------------------------------------------------------------- logits helpers


def test_entropy_from_logits() -> None:
    logits = t([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -float("inf"), -float("inf")]],
                [[1000.0, 1000.0, -float("inf"), 0.0], [5.0, 5.0, 5.0, 5.0]]])
    # uniform over 4: ln 4 = 1.3862944 ; p = [1/4, 3/4]: 0.25 ln4 + 0.75 ln(4/3) = 0.5623351
    # [1000, 1000, -inf, 0]: two equal huge logits dominate -> ln 2 = 0.6931472 ; uniform -> ln 4
    expect = t([[1.3862943611, 0.5623351446], [0.6931471806, 1.3862943611]])
    assert_close(entropy_from_logits(logits), expect)
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 3, 11, generator=g, dtype=torch.float64) * 4
    p = z.softmax(-1)
    assert_close(entropy_from_logits(z), -(p * p.log()).sum(-1))


def test_log_probs_from_logits() -> None:
    logits = t([[[0.0, math.log(3)], [0.0, math.log(3)]]])
    labels = torch.tensor([[1, 0]])
    # p = [1/4, 3/4]: log(3/4) = -0.2876821, log(1/4) = -1.3862944
    assert_close(log_probs_from_logits(logits, labels), t([[-0.2876820725, -1.3862943611]]))
    # T=2: logits [0, ln3/2] -> p1 = sqrt3/(1+sqrt3) = 0.6339746 -> log = -0.4557464 ;
    # p0 = 1/(1+sqrt3) = 0.3660254 -> log = -1.0050525
    hot = log_probs_from_logits(logits, labels, temperature=2.0)
    assert_close(hot, t([[-0.4557463944, -1.0050525387]]))
    with pytest.raises(ValueError):
        log_probs_from_logits(logits, labels, temperature=0.0)
    g = torch.Generator().manual_seed(4)
    z = torch.randn(2, 3, 9, generator=g)
    lab = torch.randint(0, 9, (2, 3), generator=g)
    ref = (z / 0.7).log_softmax(-1).gather(-1, lab[..., None]).squeeze(-1)
    assert_close(log_probs_from_logits(z, lab, temperature=0.7), ref)
    # low-precision path agrees with the fp32 one up to bf16 resolution
    lp16 = log_probs_from_logits(z.bfloat16(), lab, temperature=0.7)
    assert lp16.dtype == torch.bfloat16
    assert_close(lp16.float(), ref, atol=0.05, rtol=0.02)


# ---------------------------------------------------------------- on-policy distillation


def test_distilled_advantages_touch_only_their_own_token() -> None:
    """A - coef * D position by position (a discount of 0), for every estimator; no reward at all with group_norm
    leaves exactly -coef * D."""
    from rlrun.algo.algorithms import distilled_advantages

    mask = t([[1, 1, 1, 0], [1, 1, 0, 0]])
    d = t([[0.5, -1.0, 2.0, 9.0], [0.25, 0.0, 7.0, 7.0]])
    scores = t([0.0, 0.0])  # no reward: every group advantage is 0
    adv, _ = compute_advantages("group_norm", scores, mask, n_samples_per_prompt=2)
    assert_close(adv, torch.zeros(2, 4, dtype=torch.float64))
    assert_close(distilled_advantages(adv, d, mask, 0.5), t([[-0.25, 0.5, -1.0, 0.0], [-0.125, 0.0, 0.0, 0.0]]))
    for estimator in ("reinforce", "rloo", "dr_grpo"):
        base, _ = compute_advantages(estimator, t([1.0, 0.0]), mask, n_samples_per_prompt=2)
        assert_close(distilled_advantages(base, d, mask, 1.0), torch.where(mask.bool(), base - d, 0.0))
