"""rlrun's RL maths against OpenRLHF 0.11.2, one test per difference (issue 11, item 1).

Every expected number is worked out by hand in the comments; none comes from running the
implementation. The OpenRLHF function each test pins is named in its docstring.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from rlrun.algo.algorithms import (
    GAMMA_ONE_ESTIMATORS,
    AdaptiveKLController,
    compute_advantages,
    compute_approx_kl,
    effective_gamma,
    gamma_override_warning,
    masked_whiten,
    sequence_mean_kl,
    shape_group_scores,
)
from rlrun.algo.losses import value_loss
from rlrun.algo.policy_losses import policy_loss
from rlrun.cli.parser import parse_args
from rlrun.config.tree import Config
from rlrun.plan.checks import check_values
from rlrun.data.rollout import pack_rows, unpack_rows
from rlrun.algo.algorithms import dynamic_filter_keep, overlong_penalty, stop_properly_penalty, truncated_rows
from rlrun.algo.algorithms import RunningMoments
from rlrun.rl.exchange import Scored
from rlrun.rl.trainer import StepSettings, Trainer
from rlrun.runtime.errors import ConfigError


def t(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# ---------------------------------------------------------------- a. KL clamps


def _kl_and_grad(log_ratio: list[float], estimator: str) -> tuple[torch.Tensor, torch.Tensor]:
    logp = t(log_ratio).requires_grad_()
    kl = compute_approx_kl(logp, torch.zeros_like(logp), estimator)  # type: ignore[arg-type]
    kl.sum().backward()
    assert logp.grad is not None
    return kl.detach(), logp.grad


def test_k1_clamped_to_10_with_zero_gradient_beyond() -> None:
    """OpenRLHF models/utils.py compute_approx_kl: value.clamp(-10, 10) for every estimator."""
    kl, grad = _kl_and_grad([5.0, 15.0, -15.0], "k1")
    assert_close(kl, t([5.0, 10.0, -10.0]))
    assert_close(grad, t([1.0, 0.0, 0.0]))


def test_k2_clamped_to_10_with_zero_gradient_beyond() -> None:
    kl, grad = _kl_and_grad([4.0, -5.0], "k2")
    # x^2/2: 16/2 = 8 (grad x = 4) ; 25/2 = 12.5 -> capped at 10 (grad 0)
    assert_close(kl, t([8.0, 10.0]))
    assert_close(grad, t([4.0, 0.0]))


def test_k3_log_ratio_and_value_clamped() -> None:
    """k3 = exp(-x) - 1 + x with x = logp - ref clamped to >= -10, then the result to <= 10."""
    kl, grad = _kl_and_grad([-2.0, -3.0, -50.0, 12.0, 1.0], "k3")
    # x=-2 : e^2 - 3 = 4.389056099 ; d/dx = 1 - e^2 = -6.389056099
    # x=-3 : e^3 - 4 = 16.0855 -> 10, grad 0
    # x=-50: x clamped to -10 first: e^10 - 11 -> 10, grad 0 (and not NaN)
    # x=12 : e^-12 + 11 = 11.000006 -> 10, grad 0
    # x=1  : e^-1 = 0.3678794412 ; d/dx = 1 - e^-1 = 0.6321205588
    assert_close(kl, t([4.389056099, 10.0, 10.0, 10.0, 0.3678794412]))
    assert_close(grad, t([-6.389056099, 0.0, 0.0, 0.0, 0.6321205588]))


def test_k3_far_policy_finite_in_fp32() -> None:
    logp = torch.tensor([-200.0, 200.0], requires_grad=True)
    kl = compute_approx_kl(logp, torch.zeros(2), "k3")
    kl.sum().backward()
    assert kl.tolist() == [10.0, 10.0]
    assert logp.grad is not None and logp.grad.tolist() == [0.0, 0.0]


# ---------------------------------------------------------------- b. gamma = 1 for group estimators


def test_gamma_forced_to_one_exactly_where_openrlhf_forces_it() -> None:
    """experience_maker.py compute_advantages_and_returns: gamma := 1 unless estimator is reinforce (or gae)."""
    assert GAMMA_ONE_ESTIMATORS == frozenset({"group_norm", "dr_grpo", "rloo", "reinforce_baseline"})
    assert effective_gamma("rloo", 0.5) == 1.0
    assert effective_gamma("reinforce", 0.5) == 0.5
    assert effective_gamma("gae", 0.5) == 0.5
    assert gamma_override_warning("group_norm", 1.0) is None
    assert gamma_override_warning("reinforce", 0.9) is None
    msg = gamma_override_warning("dr_grpo", 0.9)
    assert msg is not None and "--gamma 0.9" in msg and "dr_grpo" in msg


def test_dr_grpo_ignores_gamma_reinforce_uses_it() -> None:
    scores = t([1.0, 3.0])  # one group of 2: dr_grpo shapes to [-1, 1]
    mask = t([[1, 1, 1], [1, 1, 0]])
    _, ret = compute_advantages("dr_grpo", scores, mask, n_samples_per_prompt=2, gamma=0.5)
    # gamma 1: the terminal reward reaches every token undiscounted
    assert_close(ret, t([[-1.0, -1.0, -1.0], [1.0, 1.0, 0.0]]))
    _, ret = compute_advantages("reinforce", scores, mask, n_samples_per_prompt=2, gamma=0.5)
    # row0: r=1 at t2 -> [0.25, 0.5, 1] ; row1: r=3 at t1 -> [1.5, 3, 0]
    assert_close(ret, t([[0.25, 0.5, 1.0], [1.5, 3.0, 0.0]]))


def test_group_norm_epsilon_is_openrlhfs_1e9() -> None:
    """(r - mean) / (std + 1e-9) (verl uses 1e-6; the two differ for tiny spreads)."""
    out = shape_group_scores(t([0.0, 1e-6]), 2, "group_norm")
    # deviations -+0.5e-6 ; unbiased std = sqrt(2 * 0.25e-12) = sqrt(0.5e-12) = 7.0710678e-7
    d = 0.5e-6 / (7.0710678118654755e-7 + 1e-9)  # = 0.70611 (with 1e-6 it would be 0.2929)
    assert_close(out, t([-d, d]))
    assert abs(d - 0.70611) < 1e-4


def test_whitening_clamps_variance_like_openrlhf() -> None:
    """experience_maker.py: (A - mean) * var.clamp(min=1e-8).rsqrt(), biased variance."""
    x = t([[1.0, 1.0 + 1e-5]])
    # deviations -+0.5e-5, var 2.5e-11 < 1e-8 -> scale 1/sqrt(1e-8) = 1e4 -> -+0.05 exactly
    assert_close(masked_whiten(x, torch.ones_like(x)), t([[-0.05, 0.05]]))


def test_no_advantage_std_norm_only_centres() -> None:
    """--algo.advantage.no_std_norm: rstd = 1, the mean is still subtracted."""
    scores = t([1.0, 3.0])
    mask = t([[1, 1], [1, 0]])
    adv, ret = compute_advantages("reinforce", scores, mask, n_samples_per_prompt=1, std_norm=False)
    # returns [[1, 1], [3, -]] ; masked mean (1 + 1 + 3)/3 = 5/3
    assert_close(ret, t([[1.0, 1.0], [3.0, 0.0]]))
    assert_close(adv, t([[-2 / 3, -2 / 3], [4 / 3, 0.0]]))


# ---------------------------------------------------------------- c. KL fed to the adaptive controller


def test_sequence_mean_kl_not_token_mean() -> None:
    """OpenRLHF info["kl"] = masked_mean(kl, mask, dim=-1), averaged over samples."""
    kl = t([[1.0, 1.0, 1.0, 1.0], [5.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = t([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    # token mean would be (4 + 5)/5 = 1.8 ; per-sequence means [1, 5], empty row left out -> 3
    assert sequence_mean_kl(kl, mask) == pytest.approx(3.0)
    assert sequence_mean_kl(kl, torch.zeros_like(mask)) == 0.0
    ctl = AdaptiveKLController(0.1, target=2.0, horizon=100)
    # error = clip(3/2 - 1, -0.2, 0.2) = 0.2 ; n_steps = rollout_batch_size * n_samples = 3 rows
    ctl.update(sequence_mean_kl(kl, mask), 3)
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 3 / 100))


# ---------------------------------------------------------------- e. value clip fraction


def test_value_clip_frac_has_no_rounding_false_positive() -> None:
    """Nothing is clipped (|v - old| = 10.7 < 20), yet in fp32 old + (v - old) = 0.6999998 != 0.7 = v."""
    v, old, ret = torch.tensor([[0.7]]), torch.tensor([[-10.0]]), torch.tensor([[2.0]])
    v_clipped = old + (v - old).clamp(-20.0, 20.0)
    # the old test, "clipped term strictly larger", fires on the rounding alone:
    assert ((v_clipped - ret) ** 2 > (v - ret) ** 2).item()
    loss, stats = value_loss(v, old, ret, torch.ones_like(v), value_clip=20.0)
    assert stats["value_clip_frac"].item() == 0.0
    # a token really clipped still counts: v=1 old=0 vc=0.2 R=2: clipped 0.2 -> 3.24 > 1
    _, stats = value_loss(t([[1.0]]), t([[0.0]]), t([[2.0]]), t([[1.0]]), value_clip=0.2)
    assert stats["value_clip_frac"].item() == 1.0


# ---------------------------------------------------------------- f. asymmetric clip and GSPO


def test_eps_clip_low_high_by_hand() -> None:
    """PolicyLoss: ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)."""
    ratio = t([[0.7, 1.25, 1.35, 0.85]])
    adv = t([[-1.0, 1.0, 1.0, -1.0]])
    mask = t([[1, 1, 1, 1]])
    logp = ratio.log().requires_grad_()
    old = torch.zeros_like(ratio)
    loss, stats = policy_loss(logp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28)
    # t0 r=.7  A=-1: max(0.7, 0.8)      = 0.8   clipped low
    # t1 r=1.25 A=1: max(-1.25, -1.25)  = -1.25 inside (1.25 < 1.28)
    # t2 r=1.35 A=1: max(-1.35, -1.28)  = -1.28 clipped high
    # t3 r=.85 A=-1: max(0.85, 0.85)    = 0.85  inside
    # mean = (0.8 - 1.25 - 1.28 + 0.85)/4 = -0.22
    assert_close(loss, t(-0.22))
    assert_close(stats["clip_frac"], t(0.5))
    assert_close(stats["clip_frac_low"], t(0.25))
    assert_close(stats["clip_frac_high"], t(0.25))
    loss.backward()
    # only inside tokens move: d(-A r)/dlogp / 4 = -1.25/4, 0.85/4
    assert logp.grad is not None
    assert_close(logp.grad, t([[0.0, -0.3125, 0.0, 0.2125]]))
    # symmetric 0.2: t1 is clipped too -> (0.8 - 1.2 - 1.2 + 0.85)/4 = -0.1875
    loss, stats = policy_loss(logp, old, adv, mask, eps_clip=0.2)
    assert_close(loss, t(-0.1875))
    assert_close(stats["clip_frac_high"], t(0.5))


def test_gspo_sequence_ratio_by_hand() -> None:
    """PolicyLoss gspo: ratio = exp(masked mean of log-ratio per sequence), per-sample loss mean."""
    log_ratio = t([[0.1, 0.3, 9.0], [-0.1, 0.0, -0.2]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    adv = t([[2.0, 2.0, 0.0], [-1.0, -1.0, -1.0]])
    logp = log_ratio.clone().requires_grad_()
    old = torch.zeros_like(logp)
    loss, stats = policy_loss(logp, old, adv, mask, eps_clip=0.1, loss_type="gspo", agg="token-mean")
    # row0: mean(0.1, 0.3) = 0.2 -> r = e^0.2 = 1.2214027582 -> clipped to 1.1: per token -2.2
    # row1: mean(-0.1, 0, -0.2) = -0.1 -> r = e^-0.1 = 0.9048374180 (inside [0.9, 1.1]): per token 0.9048374180
    # seq-mean-token-mean is forced: (-2.2 + 0.9048374180)/2 = -0.6475812910
    assert_close(loss, t(-0.6475812910))
    # approx_kl stays token level: -(0.1 + 0.3 - 0.1 + 0 - 0.2)/5 = -0.02
    assert_close(stats["approx_kl"], t(-0.02))
    assert_close(stats["clip_frac"], t(2 / 5))  # both tokens of row0
    loss.backward()
    # row0 clipped: no grad. row1 loss = r/2 ; dr/dlogp_t = r/3 -> r/6 = 0.1508062363 on each token
    assert logp.grad is not None
    assert_close(logp.grad, t([[0.0, 0.0, 0.0], [0.1508062363] * 3]))


# ---------------------------------------------------------------- f. dynamic filtering


def test_dynamic_filter_keep_by_hand() -> None:
    """samples_generator.py: keep a group when min_r < mean(scores) < max_r (strict)."""
    scores = t([1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1])
    # group means 0.75, 0, 1
    keep = dynamic_filter_keep(scores, 4, (0.0, 1.0))
    assert keep.tolist() == [True] * 4 + [False] * 8
    keep = dynamic_filter_keep(scores, 4, (-0.5, 1.0))
    assert keep.tolist() == [True] * 8 + [False] * 4


def test_masked_rows_are_exactly_dropped_for_token_mean() -> None:
    """Zeroing a filtered row's mask (and counting tokens from that mask) equals removing the row."""
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(4, 5, generator=g, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(4, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(4, 5, generator=g, dtype=torch.float64)
    mask = t([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    keep = torch.tensor([True, False, True, False])
    filtered = mask * keep[:, None]
    a = logp.clone().requires_grad_()
    loss_masked, _ = policy_loss(a, old, adv, filtered, eps_clip=0.2, num_tokens=float(filtered.sum()))
    loss_masked.backward()
    b = logp[keep].clone().requires_grad_()
    loss_dropped, _ = policy_loss(b, old[keep], adv[keep], mask[keep], eps_clip=0.2)
    loss_dropped.backward()
    assert_close(loss_masked, loss_dropped)
    assert a.grad is not None and b.grad is not None
    assert_close(a.grad[keep], b.grad)
    assert (a.grad[~keep] == 0).all()


# ---------------------------------------------------------------- f. length penalties


def test_overlong_penalty_by_hand() -> None:
    """length_penalty.py apply_overlong_penalty: -min(len - (max - buf), buf) / buf * factor if > 0."""
    lengths = torch.tensor([3, 6, 7, 9, 10])
    # max 10, buffer 4 -> expected 6 ; exceed [-3, 0, 1, 3, 4] -> [0, 0, -1/4, -3/4, -1] * 0.5
    assert_close(overlong_penalty(lengths, 10, 4, 0.5), t([0.0, 0.0, -0.125, -0.375, -0.5]))
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 10, 11, 1.0)


def test_stop_properly_penalty_by_hand() -> None:
    """length_penalty.py apply_stop_properly_penalty: scale by coef >= 0, replace by coef < 0."""
    rewards, cut = t([1.0, 0.5, 2.0]), torch.tensor([True, False, True])
    assert_close(stop_properly_penalty(rewards, cut, 0.5), t([0.5, 0.5, 1.0]))
    assert_close(stop_properly_penalty(rewards, cut, -0.3), t([-0.3, 0.5, -0.3]))


def test_truncated_rows_is_finish_reason_length() -> None:
    eos = 2
    responses = torch.tensor([[5, 6, 2], [5, 6, 7], [5, 0, 0], [5, 6, 9]])
    lengths = torch.tensor([3, 3, 1, 3])
    # row0 hit the limit but ended with EOS ("stop") ; row1 hit it without EOS ; row2 is short ; row3 ended with
    # the model's other stop id (Qwen's <|endoftext|> beside <|im_end|>): a "stop" only when that id is listed
    assert truncated_rows(responses, lengths, 3, (eos,)).tolist() == [False, True, False, True]
    assert truncated_rows(responses, lengths, 3, (eos, 9)).tolist() == [False, True, False, False]


# ---------------------------------------------------------------- the trainer's orchestration


def _scored(scores: torch.Tensor, old_log_probs: torch.Tensor) -> Scored:
    return Scored(scores, old_log_probs, ref_log_probs=None, teacher_log_probs=None, values=None)


def _bare_trainer(cfg: Config) -> Trainer:
    """Trainer.advantages needs only its settings (the tokenizer's EOS id among them), the running reward statistics
    and the KL controller."""
    tr = Trainer.__new__(Trainer)
    tr.s = StepSettings(cfg.algo, cfg.train, cfg.generation.generate_max_len, end_ids=(2,), ref_by_actor=False)
    tr.moments = RunningMoments()
    tr.kl = SimpleNamespace(value=0.0)  # type: ignore[assignment]
    return tr


def test_trainer_advantages_filter_penalties_and_order() -> None:
    cfg = parse_args(["--advantage_estimator", "dr_grpo", "--n_samples_per_prompt", "2", "--generate_max_len", "4",
                      "--init_kl_coef", "0", "--dynamic_filtering", "--overlong_buffer_len", "2",
                      "--stop_properly_penalty_coef", "-0.5"]).config
    responses = [[5, 6, 7, 8], [2], [5, 6, 2], [5, 2]]
    batch = unpack_rows(pack_rows([[10]] * 4, responses, 2, 4, 0), 2)
    scored = _scored(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.zeros(4, 4))
    tr = _bare_trainer(cfg)
    mask = batch.action_mask.clone()
    out = tr.advantages(batch, scored, batch.action_mask)
    kl, adv, ret, shaping = out.kl, out.advantages, out.returns, out.shaping
    # filter on RAW scores: group means 0.5 (kept), 1.0 (dropped); the batch's own mask is left as it was
    assert out.action_mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert torch.equal(batch.action_mask, mask)
    # overlong (max 4, buffer 2, expected 2): lengths [4, 1, 3, 2] -> [-1, 0, -0.5, 0] -> [0, 0, 0.5, 1]
    # stop-properly: only row0 is cut off (4 tokens, no EOS) -> replaced by -0.5 -> [-0.5, 0, 0.5, 1]
    # dr_grpo group0: mean -0.25 -> [-0.25, 0.25] ; dropped group -> 0 everywhere
    assert_close(adv, torch.tensor([[-0.25] * 4, [0.25, 0, 0, 0], [0.0] * 4, [0.0] * 4]))
    assert_close(ret, adv)
    assert shaping == {"dynamic_filtering/kept_frac": 0.5, "reward/overlong_frac": 0.5,
                                 "reward/truncated_frac": 0.25}
    assert kl.abs().sum() == 0


def test_normalize_reward_no_longer_runs_the_running_norm() -> None:
    """--normalize_reward is the reward model's config mean/std now; --running_reward_norm is the old one."""
    batch = unpack_rows(pack_rows([[10]] * 2, [[5, 2], [5, 2]], 2, 2, 0), 2)
    scored = _scored(torch.tensor([1.0, 3.0]), torch.zeros(2, 2))
    base = ["--advantage_estimator", "reinforce", "--init_kl_coef", "0", "--no_advantage_std_norm"]
    tr = _bare_trainer(parse_args([*base, "--normalize_reward"]).config)
    adv = tr.advantages(batch, scored, batch.action_mask).advantages
    assert tr.moments.count == 0
    # reinforce, mean-centred only: [1, 3] - 2 on both tokens
    assert_close(adv, torch.tensor([[-1.0, -1.0], [1.0, 1.0]]))
    tr = _bare_trainer(parse_args([*base, "--running_reward_norm"]).config)
    tr.advantages(batch, scored, batch.action_mask)
    # running stats of [1, 3]: count 2, mean 2, population std 1
    assert (tr.moments.count, tr.moments.mean, tr.moments.std) == (2.0, 2.0, 1.0)


# ---------------------------------------------------------------- d. reward model mean/std


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny sequence-classification model saved with OpenRLHF's mean/std in its config.json."""
    from rlrun.models.loading import scalar_model_from

    cfg = Config()
    model = scalar_model_from(None, cfg.model, cfg.train.seed, torch.float32)
    model.config.mean, model.config.std = 2.0, 4.0
    path = tmp_path_factory.mktemp("rm")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("role", ["reward", "critic"])
def test_normalize_reward_uses_config_mean_std(reward_dir: Path, role: str) -> None:
    """models/model.py: reward (and critic values) = (x - config.mean) / config.std."""
    from rlrun.models.loading import load_critic, load_reward_model, score_head

    ids = torch.tensor([[3, 4, 5]])
    attn = torch.ones_like(ids)
    for normalize, expected in ((False, 0.0), (True, (0.0 - 2.0) / 4.0)):
        flag = f"--{role}_pretrain"
        cfg = parse_args([flag, str(reward_dir), *(["--normalize_reward"] if normalize else [])]).config
        norm = cfg.algo.normalize_reward
        if role == "reward":
            unfilled = load_reward_model(cfg.model, cfg.reward.reward_pretrain, cfg.train.seed, normalize=norm)
        else:
            unfilled = load_critic(cfg.model, cfg.critic.critic_pretrain, None, cfg.train.seed, normalize=norm)
        model = unfilled.fill(torch.device("cpu"))
        with torch.no_grad():
            score_head(model.hf).weight.zero_()  # raw output 0 at every position
            out = model(ids, attn)
        assert_close(out, torch.full((1, 3), expected))


def test_config_without_mean_std_is_untouched() -> None:
    from rlrun.models.loading import config_mean_std

    assert config_mean_std(SimpleNamespace()) is None
    assert config_mean_std(SimpleNamespace(mean=1.5, std=0.5)) == (1.5, 0.5)
    with pytest.raises(ConfigError, match="std=0.0"):
        config_mean_std(SimpleNamespace(mean=1.5, std=0.0))


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize("argv, match", [
    (["--dynamic_filtering"], "n_samples_per_prompt >= 2, got 1"),
    (["--dynamic_filtering", "--n_samples_per_prompt", "2", "--dynamic_filtering_reward_range", "1", "0"], "LOW < HIGH"),
    (["--eps_clip_low_high", "1.2", "0.28"], "--eps_clip_low_high 1.2 0.28"),
    (["--overlong_buffer_len", "300", "--generate_max_len", "256"], "--overlong_buffer_len 300"),
    (["--overlong_penalty_factor", "-1"], "--overlong_penalty_factor"),
    (["--stop_properly_penalty_coef", "1.5"], "--stop_properly_penalty_coef 1.5"),
])
def test_new_options_validated(argv: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        check_values(parse_args(argv).config)


def test_new_options_accepted() -> None:
    cfg = parse_args(["--eps_clip_low_high", "0.2", "0.28", "--policy_loss_type", "gspo", "--dynamic_filtering",
                      "--n_samples_per_prompt", "4", "--overlong_buffer_len", "64", "--stop_properly_penalty_coef",
                      "-0.5", "--no_advantage_std_norm", "--running_reward_norm"]).config
    check_values(cfg)
    assert cfg.algo.eps_clip_low_high == (0.2, 0.28) and cfg.algo.policy_loss_type == "gspo"
    assert math.isclose(cfg.algo.overlong_penalty_factor, 1.0)


def test_gamma_override_is_reported_once_at_planning() -> None:
    """The plan (printed once by rank 0 before anything starts) names an ignored --gamma; a used one is silent."""
    from rlrun.cli.parser import parse_args
    from rlrun.plan.plan import lay_out

    batch = ["--rollout_batch_size", "4", "--train_batch_size", "8", "--micro_train_batch_size", "2"]
    grpo = parse_args(["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--gamma", "0.9", *batch])
    assert [w for w in lay_out(grpo.config, 1, 1).warnings if w.startswith("--gamma 0.9 is ignored")]
    reinforce = parse_args(["--advantage_estimator", "reinforce", "--gamma", "0.9", "--n_samples_per_prompt", "2", *batch])
    assert not [w for w in lay_out(reinforce.config, 1, 1).warnings if "gamma" in w]


def test_no_correction_still_logs_the_mismatch_diagnostics() -> None:
    """verl's `disabled` rollout-correction preset (and its default) is metrics-only: with the engine's and the actor's
    log-probs both there, rollout_corr/* are logged and nothing is weighted or rejected (issue 61, item 7)."""
    cfg = parse_args(["--rollout_correction", "disabled", "--generation_backend", "native"]).config
    batch = unpack_rows(pack_rows([[10]] * 2, [[5, 2], [5, 2]], 2, 2, 0), 2)
    batch.engine_log_probs = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]])
    tr = _bare_trainer(cfg)
    weights, mask, metrics = tr.correct_rollouts(batch, _scored(torch.tensor([1.0, 0.0]), torch.tensor([[-1.0, -1.0],
                                                                                                        [-0.5, -0.5]])))
    assert weights is None and torch.equal(mask, batch.action_mask)
    # KL(rollout || train) by k1: mean(rollout - train) over the 4 tokens = (0 - 1 + 0 + 0) / 4
    assert metrics["rollout_corr/kl"] == pytest.approx(-0.25)
    assert {"rollout_corr/training_ppl", "rollout_corr/chi2_token", "rollout_corr/log_ppl_diff"} <= metrics.keys()
    no_engine = unpack_rows(pack_rows([[10]] * 2, [[5, 2], [5, 2]], 2, 2, 0), 2)
    assert tr.correct_rollouts(no_engine, _scored(torch.tensor([1.0, 0.0]), torch.zeros(2, 2)))[2] == {}
