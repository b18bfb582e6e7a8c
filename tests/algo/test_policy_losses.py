"""The policy losses of verl's registry (rlrun.algo.policy_losses) against hand-computed cases and against an
independent element-by-element reading of verl 0.10's formulas (verl/trainer/ppo/core_algos.py at 1dda039) on random
tensors. The hand numbers were worked out from the formulas; the loops below are written from the same formulas, one
token at a time, so that a vectorisation slip in rlrun cannot hide in both."""

from __future__ import annotations

import math

import pytest
import torch

from rlrun.algo.losses import aggregate_loss
from rlrun.algo.policy_losses import POLICY_LOSS_TYPES, PolicyLossParams, check_params, policy_loss
from rlrun.config.algorithm import PolicyLossType


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


def run(loss_type, logp, old, adv, mask, **kw):
    """(loss, stats, d loss / d logp) of one call."""
    lp = t(logp).clone().requires_grad_(True)
    loss, stats = policy_loss(lp, t(old), t(adv), t(mask), loss_type=loss_type, eps_clip=kw.pop("eps", 0.2), **kw)
    loss.backward()
    return float(loss), {k: float(v) for k, v in stats.items()}, lp.grad


def logs(values) -> list[list[float]]:
    return [[math.log(v) for v in row] for row in values]


def test_the_config_names_the_same_losses() -> None:
    assert POLICY_LOSS_TYPES == PolicyLossType.__args__  # type: ignore[attr-defined]


# ---- hand-computed cases (1 row x 3 tokens unless said) ----------------------------------------------------------


def test_ppo_clip_and_dual_clip() -> None:
    # r = [1, 1.5, 0.5], A = 1: per token max(-r, -clip(r)) = [-1, -1.2, -0.5]
    loss, stats, grad = run("ppo", logs([[1, 1.5, 0.5]]), [[0, 0, 0]], [[1, 1, 1]], [[1, 1, 1]])
    assert loss == pytest.approx(-0.9) and stats["clip_frac"] == pytest.approx(1 / 3)
    assert stats["approx_kl"] == pytest.approx(0.095894, abs=1e-6)
    assert torch.allclose(grad, t([[-1 / 3, 0.0, -1 / 6]]))
    # A = -1, r = [1, 1.5, 4], dual clip 3: [1, 1.5, min(4, 3)]
    loss, stats, _ = run("ppo", logs([[1, 1.5, 4]]), [[0, 0, 0]], [[-1, -1, -1]], [[1, 1, 1]], dual_clip=3.0)
    assert loss == pytest.approx(5.5 / 3) and stats["dual_clip_frac"] == pytest.approx(1 / 3)
    # weights after the clips: [-2.4, 0.8] x [0.5, 2] over the 2 valid tokens
    loss, stats, _ = run(
        "ppo", logs([[1.25, 0.5, 9]]), [[0, 0, 0]], [[2, -1, 5]], [[1, 1, 0]], dual_clip=3.0, weights=t([[0.5, 2, 1]])
    )
    assert loss == pytest.approx(0.2) and stats["clip_frac"] == pytest.approx(1.0)


def test_gspo_one_ratio_per_sequence() -> None:
    delta = [[0.1, 0.2, 0.3]]  # mean 0.2: s = e^0.2 = 1.221403 for every token
    loss, stats, grad = run("gspo", delta, [[0, 0, 0]], [[1, 1, 1]], [[1, 1, 1]])
    assert loss == pytest.approx(-1.2) and stats["clip_frac"] == pytest.approx(1.0)
    assert torch.allclose(grad, torch.zeros(1, 3, dtype=torch.float64))
    loss, _, grad = run("gspo", delta, [[0, 0, 0]], [[-1, -1, -1]], [[1, 1, 1]])
    assert loss == pytest.approx(math.exp(0.2))
    assert torch.allclose(grad, t([[math.exp(0.2) / 3] * 3]))
    # row 0: mean log-ratio 0 (the masked 7 is not counted), A = 0.5 -> -0.5; row 1: e^-0.3 clipped to 0.8, A = -2
    loss, stats, _ = run(
        "gspo", [[0.05, -0.05, 7.0], [-0.3, -0.3, -0.3]], [[0, 0, 0]] * 2, [[0.5] * 3, [-2] * 3], [[1, 1, 0], [1, 1, 1]]
    )
    assert loss == pytest.approx(0.55) and stats["clip_frac"] == pytest.approx(0.6)


def test_sapo_soft_gate() -> None:
    assert run("sapo", [[0.0]], [[0.0]], [[1.0]], [[1.0]])[0] == pytest.approx(-2.0)  # r = 1: -(2 / tau) A
    assert run("sapo", [[0.0]], [[0.0]], [[-1.0]], [[1.0]])[0] == pytest.approx(2 / 1.05)
    loss, _, grad = run("sapo", logs([[2, 0.5, 1]]), [[0, 0, 0]], [[1, -1, 1]], [[1, 1, 1]])
    assert loss == pytest.approx(-1.169432, abs=1e-6)
    assert torch.allclose(grad, t([[-0.524298, 0.155690, -1 / 3]]), atol=1e-6)


def test_gpg_is_reinforce() -> None:
    logp = [[-1.0, -2.0, -0.5]]
    loss, _, grad = run("gpg", logp, [[0, 0, 0]], [[1, 1, 1]], [[1, 1, 1]])
    assert loss == pytest.approx(3.5 / 3) and torch.allclose(grad, t([[-1 / 3] * 3]))
    loss, _, _ = run("gpg", [[-1, -2, -9], [-0.5] * 3], [[0] * 3] * 2, [[1] * 3, [2] * 3], [[1, 1, 0], [1] * 3],
                     agg="seq-mean-token-sum")
    assert loss == pytest.approx(3.0)


def test_cispo_keeps_every_tokens_gradient() -> None:
    logp = [[-1.0, -2.0, -0.5]]
    old = [[-1.0, -2.0 - math.log(1.5), -0.5 - math.log(0.5)]]  # r = [1, 1.5, 0.5]
    loss, stats, grad = run("cispo", logp, old, [[1, 1, 1]], [[1, 1, 1]])
    assert loss == pytest.approx(3.8 / 3) and stats["clip_frac"] == pytest.approx(2 / 3)
    assert torch.allclose(grad, t([[-1 / 3, -0.4, -0.8 / 3]]))
    loss, stats, _ = run("cispo", logp, old, [[1, 1, 1]], [[1, 1, 1]], eps=10.0, eps_clip_high=0.2)  # verl's example
    assert loss == pytest.approx(3.65 / 3) and stats["clip_frac"] == pytest.approx(1 / 3)


def test_clip_cov_detaches_a_covariance_selected_token() -> None:
    logp = [[-0.1, -1.0, -2.0]]
    # on-policy, A = [3, 0, 0]: cov = [1.8667, -0.0333, 0.9667], only t0 is in (1, 5): detached, loss 0
    loss, stats, grad = run("clip_cov", logp, logp, [[3, 0, 0]], [[1, 1, 1]])
    assert loss == pytest.approx(0.0) and stats["cov_detached_frac"] == pytest.approx(1 / 3)
    assert torch.equal(grad, torch.zeros(1, 3, dtype=torch.float64))
    # t0's ratio 1.5 is clipped already, so it is no candidate: plain PPO
    old = [[-0.1 - math.log(1.5), -1.0, -2.0]]
    loss, stats, _ = run("clip_cov", logp, old, [[3, 0, 0]], [[1, 1, 1]])
    assert loss == pytest.approx(-1.2) and stats["cov_detached_frac"] == 0.0 and stats["clip_frac"] == pytest.approx(
        1 / 3
    )
    # two candidates (t0, t2), one drawn: the loss is one of two values, as the draw says
    torch.manual_seed(0)
    seen = {round(run("clip_cov", logp, logp, [[3, 1, 0]], [[1, 1, 1]])[0], 6) for _ in range(12)}
    assert seen == {round(-1 / 3, 6), round(-4 / 3, 6)}


def test_kl_cov_penalises_the_top_covariance_token() -> None:
    logp, delta = [[-0.1, -1.0, -2.0]], [0.2, 0.0, -0.1]
    old = [[lp - d for lp, d in zip(logp[0], delta)]]
    loss, stats, grad = run("kl_cov", logp, old, [[3, 0, 0]], [[1, 1, 1]])
    assert loss == pytest.approx((-3 * math.exp(0.2) + 0.02) / 3)
    assert stats["abs_kl"] == pytest.approx(0.1) and stats["cov_penalised_frac"] == pytest.approx(1 / 3)
    assert float(grad[0, 0]) == pytest.approx((-3 * math.exp(0.2) + 0.1) / 3)
    loss, _, _ = run("kl_cov", logp, old, [[-3, 0, 0]], [[1, 1, 1]])  # t1 selected now, its penalty is 0
    assert loss == pytest.approx(math.exp(0.2))


def test_geo_mean_clips_in_log_space() -> None:
    delta = [[0.1, 0.5, -0.6]]
    loss, stats, grad = run("geo_mean", delta, [[0, 0, 0]], [[1, 1, 1]], [[1, 1, 1]], eps=0.4)
    assert loss == pytest.approx(-math.exp(-0.1 / 3)) and stats["clip_frac_high"] == pytest.approx(2 / 3)
    assert torch.allclose(grad, t([[-math.exp(-0.1 / 3) / 3, 0.0, -math.exp(-0.1 / 3) / 3]]))
    loss, stats, _ = run("geo_mean", delta, [[0, 0, 0]], [[-1, -1, -1]], [[1, 1, 1]], eps=0.4)
    assert loss == pytest.approx(math.exp(0.2 / 3)) and stats["clip_frac_low"] == pytest.approx(2 / 3)
    # the sequence's geometric-mean weight (0.5 x 2 -> 1); an empty row counts without num_seqs, as in verl
    loss, _, _ = run(
        "geo_mean", [[0.2, 0.2, 9.0], [0, 0, 0]], [[0] * 3] * 2, [[2] * 3, [5] * 3], [[1, 1, 0], [0, 0, 0]], eps=0.4,
        weights=t([[0.5, 2, 7], [1, 1, 1]])
    )
    assert loss == pytest.approx(-math.exp(0.2))


def test_dppo_trust_regions() -> None:
    old, new = logs([[0.5, 0.5, 0.01]]), logs([[0.6, 0.7, 0.05]])
    loss, stats, grad = run("dppo_tv", new, old, [[1, 1, 1]], [[1, 1, 1]], eps=0.15, dual_clip=20.0)
    assert loss == pytest.approx(5.197217, abs=1e-6) and stats["clip_frac"] == pytest.approx(1 / 3)
    assert torch.allclose(grad, t([[-0.4, 0.0, -5 / 3]]))
    old, new = logs([[0.5, 0.1, 0.9]]), logs([[0.2, 0.4, 0.8]])  # A < 0, cap 3 (the default)
    loss, stats, _ = run("dppo_tv", new, old, [[-1, -1, -1]], [[1, 1, 1]])
    assert loss == pytest.approx(-0.982407, abs=1e-6) and stats["ratio_cap_frac"] == pytest.approx(1 / 3)
    old, new = logs([[0.5, 0.5, 0.5]]), logs([[0.6, 0.7, 0.1]])
    loss, stats, grad = run("dppo_kl", new, old, [[1, 1, 1]], [[1, 1, 1]], eps=0.05, dual_clip=1e4)
    assert loss == pytest.approx(0.357836, abs=1e-6) and stats["clip_frac"] == pytest.approx(1 / 3)
    assert torch.allclose(grad, t([[-0.4, 0.0, -0.2 / 3]]))
    old, new = logs([[0.9, 0.9, 0.01]]), logs([[0.8, 0.7, 0.05]])
    loss, _, _ = run("dppo_kl", new, old, [[-1, -1, -1]], [[1, 1, 1]], eps=0.05)
    assert loss == pytest.approx(-3.061849, abs=1e-6)


def test_dro_quadratic_penalty() -> None:
    params = PolicyLossParams(dro_beta=0.05)
    loss, _, grad = run("dro", [[-0.8, -0.9, -0.1]], [[-1, -0.7, -0.2]], [[2, -1.5, 9]], [[1, 1, 0]], params=params)
    assert loss == pytest.approx(0.126) and torch.allclose(grad, t([[-0.995, 0.745, 0.0]]))
    with pytest.raises(ValueError, match="dro_beta"):
        run("dro", [[0.0]], [[0.0]], [[1.0]], [[1.0]])


def test_bad_parameters_are_named() -> None:
    assert "dual_clip" in check_params("ppo", 1.0, PolicyLossParams())
    assert check_params("dppo_tv", 0.5, PolicyLossParams()) is None  # a cap, not a dual clip
    assert "dro_beta" in check_params("dro", None, PolicyLossParams())
    assert "lb < ub" in check_params("clip_cov", None, PolicyLossParams(clip_cov_bounds=(5.0, 1.0)))
    with pytest.raises(ValueError, match="unknown policy loss type 'vanilla'"):
        check_params("vanilla", None, PolicyLossParams())


# ---- an element-by-element reading of verl's formulas on random tensors ------------------------------------------


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _reference_per_token(loss_type: str, lp: float, old: float, a: float, eps=(0.2, 0.28), cap=3.0) -> float:
    """One token's loss value as verl writes it (the covariance losses and geo_mean are sequence/batch-level)."""
    r = math.exp(max(-20.0, min(20.0, lp - old)))
    clip = min(max(r, 1 - eps[0]), 1 + eps[1])
    if loss_type == "ppo":
        return max(-a * r, -a * clip)
    if loss_type == "cispo":
        return -clip * a * lp
    if loss_type == "sapo":
        tau = 1.0 if a > 0 else 1.05
        return -_sig(tau * (r - 1)) * 4 / tau * a
    if loss_type == "gpg":
        return -a * lp
    if loss_type in ("dppo_tv", "dppo_kl"):
        p, q = math.exp(lp), math.exp(old)
        if loss_type == "dppo_tv":
            valid = p - q <= eps[1] if a > 0 else p - q >= -eps[0]
        else:
            d = q * (old - lp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
            valid = (d <= eps[1] or p <= q) if a > 0 else (d <= eps[0] or p >= q)
        return -a * min(r, cap) * lp * valid
    if loss_type == "dro":
        return -(lp * a - 0.5 * 0.05 * (lp - old) ** 2)
    raise AssertionError(loss_type)


@pytest.mark.parametrize("loss_type", ["ppo", "cispo", "sapo", "gpg", "dppo_tv", "dppo_kl", "dro"])
def test_per_token_losses_equal_a_token_by_token_reading(loss_type: str) -> None:
    g = torch.Generator().manual_seed(7)
    b, T = 5, 9
    logp = -torch.rand(b, T, generator=g, dtype=torch.float64) * 3
    old = (logp + 0.4 * torch.randn(b, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(b, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, T, generator=g) > 0.2).double()
    weights = torch.rand(b, T, generator=g, dtype=torch.float64) * 2
    ref = t([[_reference_per_token(loss_type, float(logp[i, j]), float(old[i, j]), float(adv[i, j]))
              for j in range(T)] for i in range(b)])
    for agg in ("token-mean", "seq-mean-token-sum"):
        got, _ = policy_loss(logp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28, loss_type=loss_type, agg=agg,
                             weights=weights, params=PolicyLossParams(dro_beta=0.05))
        forced = "seq-mean-token-mean" if loss_type == "sapo" else agg
        assert float(got) == pytest.approx(float(aggregate_loss(ref * weights, mask, forced)), rel=1e-7)


def test_geo_mean_and_gspo_equal_a_sequence_by_sequence_reading() -> None:
    g = torch.Generator().manual_seed(3)
    b, T = 4, 6
    logp = -torch.rand(b, T, generator=g, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(b, T, generator=g, dtype=torch.float64)
    adv = torch.randn(b, 1, generator=g, dtype=torch.float64).expand(b, T)
    mask = torch.ones(b, T, dtype=torch.float64)
    mask[1, 4:] = 0
    geo, gspo = [], []
    for i in range(b):
        n = int(mask[i].sum())
        deltas = [float(logp[i, j] - old[i, j]) for j in range(n)]
        a = float(adv[i, 0])
        capped = [min(d, 0.28) if a > 0 else max(d, -0.2) for d in deltas]
        geo.append(-a * math.exp(sum(capped) / n))
        s = math.exp(sum(deltas) / n)
        gspo.append(max(-a * s, -a * min(max(s, 0.8), 1.28)))
    got, _ = policy_loss(logp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28, loss_type="geo_mean")
    assert float(got) == pytest.approx(sum(geo) / b, rel=1e-7)  # verl divides by n + 1e-8
    got, _ = policy_loss(logp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28, loss_type="gspo")
    assert float(got) == pytest.approx(sum(gspo) / b, rel=1e-9)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "gpg", "geo_mean", "dppo_kl", "dro"])
def test_micro_batches_with_global_counts_give_the_full_batch_gradient(loss_type: str) -> None:
    """Summing micro-batch losses normalised by the whole mini-batch's counts is the full batch's loss (what the
    Updater does), for every loss whose value is a sum over tokens or sequences."""
    g = torch.Generator().manual_seed(11)
    b, T = 6, 5
    logp = (-torch.rand(b, T, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    old = (logp.detach() + 0.2 * torch.randn(b, T, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    adv = torch.randn(b, T, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, T, generator=g) > 0.3).double()
    kw = {"eps_clip": 0.2, "loss_type": loss_type, "params": PolicyLossParams(dro_beta=0.1)}
    counts = {"num_tokens": float(mask.sum()), "num_seqs": float(b)}
    full, _ = policy_loss(logp, old, adv, mask, **kw, **counts)
    (full_grad,) = torch.autograd.grad(full, logp)
    parts = sum(policy_loss(logp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], **kw, **counts)[0]
                for i in range(0, b, 2))
    (part_grad,) = torch.autograd.grad(parts, logp)
    assert float(parts) == pytest.approx(float(full), rel=1e-9)
    assert torch.allclose(part_grad, full_grad, rtol=1e-9, atol=1e-12)


def test_gspo_token_is_verls_gspo_each_token_its_own_advantage_and_gradient() -> None:
    """verl's gspo (loss_mode=gspo -> gspo_token): the same value as OpenRLHF's form, but token t's gradient is
    -A_t s_i / (L N) where OpenRLHF's spreads the sequence's mean advantage. Hand-computed, eps 0.2, old = 0:
    row 0: log-ratios [0.3, 0, 0] -> s = e^0.1 = 1.105171 (inside the clip), A = [1, 0, -1];
    row 1: log-ratios 1.5 -> s = e^1.5 = 4.481689, clipped 1.2, A = [-1, -2, -0.5]: max(-A s, -A 1.2) = -A s."""
    delta, adv = [[0.3, 0.0, 0.0], [1.5, 1.5, 1.5]], [[1.0, 0.0, -1.0], [-1.0, -2.0, -0.5]]
    s0, s1 = math.exp(0.1), math.exp(1.5)
    expected = (0.0 + (1 + 2 + 0.5) * s1 / 3) / 2  # row 0's token mean is 0
    loss, _, grad = run("gspo_token", delta, [[0, 0, 0]] * 2, adv, [[1, 1, 1]] * 2)
    assert loss == pytest.approx(expected, rel=1e-6) and expected == pytest.approx(2.614319, abs=1e-6)
    want = t([[-s0 / 6, 0.0, s0 / 6], [s1 / 6, 2 * s1 / 6, 0.5 * s1 / 6]])
    assert torch.allclose(grad, want, atol=1e-6)
    # OpenRLHF's form: the same value, every token of a row the row's mean-advantage gradient (row 0: mean A is 0)
    loss_openrlhf, _, grad_openrlhf = run("gspo", delta, [[0, 0, 0]] * 2, adv, [[1, 1, 1]] * 2)
    assert loss_openrlhf == pytest.approx(expected, rel=1e-6)
    assert torch.allclose(grad_openrlhf, t([[0.0] * 3, [3.5 / 3 * s1 / 6] * 3]), atol=1e-6)
    # no dual clip: a cap would have changed row 1 ([3, 6, 1.5] at dual_clip 3)
    assert run("gspo_token", delta, [[0, 0, 0]] * 2, adv, [[1, 1, 1]] * 2, dual_clip=3.0)[0] == pytest.approx(expected)


def test_verls_gspo_key_runs_verls_form() -> None:
    from rlrun.cli.parser import parse_args

    assert parse_args(["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"]).config.algo.policy_loss_type == "gspo_token"
    assert parse_args(["--policy_loss_type", "gspo"]).config.algo.policy_loss_type == "gspo"
