"""Advantages, returns and KL for PPO / GRPO / RLOO / REINFORCE++: pure tensor maths.

Everything here is a stateless function of tensors (the KL controllers hold one
float): masked statistics, the per-token KL estimators, token-level rewards, the
per-prompt group baselines, GAE / discounted returns and the KL-coefficient
controllers. The losses that consume these live in rlrun.algo.losses. Nothing here runs
a collective: anything that must be global (advantage whitening across ranks) is the
caller's job.

Shape conventions: ``B`` rows (sequences), ``T`` response positions.
Masks are 0/1 (any dtype) with 1 on response tokens; responses are right-padded,
but GAE/returns also tolerate holes in the mask (masked positions are skipped).
Semantics follow OpenRLHF (openrlhf/models/utils.py, experience_maker.py, kl_controller.py)
and verl core_algos.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k2", "k3"]
AdvantageEstimator = Literal["gae", "group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline"]

KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
ADVANTAGE_ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
# Estimators whose baseline comes from the reward signal itself, so no critic is trained.
GROUP_ESTIMATORS: frozenset[str] = frozenset(ADVANTAGE_ESTIMATORS) - {"gae"}
# Estimators that subtract a per-prompt group statistic and so need n_samples_per_prompt > 1.
_NEEDS_GROUP: frozenset[str] = frozenset({"group_norm", "dr_grpo", "rloo", "reinforce_baseline"})
# Estimators whose advantages get REINFORCE++-style global whitening.
_WHITENED: frozenset[str] = frozenset({"gae", "reinforce", "reinforce_baseline"})
# Estimators OpenRLHF runs with gamma = 1 whatever --gamma says (experience_maker.py,
# compute_advantages_and_returns): the group baseline is a sequence-level quantity, and
# discounting the terminal score per token would make it depend on the response length.
GAMMA_ONE_ESTIMATORS: frozenset[str] = _NEEDS_GROUP

# OpenRLHF bounds every KL estimate to [-KL_CLAMP, KL_CLAMP] and k3's log-ratio from below at
# -KL_CLAMP (openrlhf/models/utils.py, compute_approx_kl): a policy far from the reference gets a
# bounded penalty, and no gradient, instead of an exploding one.
KL_CLAMP = 10.0


def _as_float(x: Tensor) -> Tensor:
    return x if x.is_floating_point() else x.to(torch.float32)


def check_choice(name: str, value: str, allowed: tuple[str, ...] | frozenset[str]) -> None:
    """ValueError naming ``value`` and every allowed choice, unless ``value`` is one of them."""
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {sorted(allowed)}")


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over entries where ``mask`` is nonzero.

    x, mask: same shape, e.g. [B, T]. Returns a scalar (dim=None) or x reduced over dim.
    An all-masked reduction returns 0 instead of NaN so empty micro-batches are harmless.
    """
    m = mask.bool().expand_as(x)
    # where() rather than x*mask: a NaN/inf at a padded position must not leak into the sum.
    xs = torch.where(m, x, 0.0)
    if dim is None:
        return xs.sum() / m.sum().clamp_min(1).to(x.dtype)
    return xs.sum(dim) / m.sum(dim).clamp_min(1).to(x.dtype)


def masked_whiten(
    x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8, divide_std: bool = True
) -> Tensor:
    """Normalise ``x`` to zero mean / unit (biased) std over masked entries.

    x, mask: [B, T] -> [B, T]; masked-out positions are 0. With ``shift_mean=False``
    the original mean is added back (only the scale changes), as in verl. With
    ``divide_std=False`` only the mean is subtracted (OpenRLHF --algo.advantage.no_std_norm).
    As in OpenRLHF the scale is rsqrt(max(var, eps)) with the biased variance.
    """
    m = mask.bool()
    mean = masked_mean(x, m)
    out = x - mean
    if divide_std:
        var = masked_mean(out**2, m)
        out = out * torch.rsqrt(var.clamp_min(eps))
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, 0.0)


def compute_approx_kl(
    log_probs: Tensor, ref_log_probs: Tensor, estimator: KLEstimator, mask: Tensor | None = None
) -> Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1/k2/k3).

    log_probs, ref_log_probs, mask: [B, T] -> [B, T]; masked positions are 0.
    With x = logp - ref: k1 = x (unbiased, can be negative); k2 = x^2 / 2;
    k3 = exp(-x) - 1 + x (unbiased and >= 0), with x first clamped to >= -KL_CLAMP.
    Every result is clamped to [-KL_CLAMP, KL_CLAMP] (OpenRLHF): beyond the bound the
    penalty is constant and its gradient is exactly 0.
    """
    check_choice("KL estimator", estimator, KL_ESTIMATORS)
    log_ratio = log_probs - ref_log_probs
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio**2
    else:
        # Below -KL_CLAMP k3 already exceeds the final cap; bounding x first keeps exp()
        # and its derivative finite, so the clamp's zero gradient is not 0 * inf = NaN.
        x = log_ratio.clamp(min=-KL_CLAMP)
        kl = (-x).exp() - 1 + x
    kl = kl.clamp(-KL_CLAMP, KL_CLAMP)
    # where() rather than *mask: an inf at a padded position must become 0, not NaN.
    return kl if mask is None else torch.where(mask.bool(), kl, 0.0)


def sequence_mean_kl(kl: Tensor, mask: Tensor) -> float:
    """Mean over sequences of each sequence's token-mean KL: [B, T], [B, T] -> float.

    This is the "kl" OpenRLHF logs and feeds its adaptive KL controller (experience_maker.py
    info["kl"], averaged per sample). Rows without response tokens are left out (OpenRLHF's
    masked_mean would make them NaN); 0 when no row has any.
    """
    m = mask.bool()
    has_tokens = m.any(dim=-1)
    if not bool(has_tokens.any()):
        return 0.0
    return float(masked_mean(kl, m, dim=-1)[has_tokens].mean())


def compute_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lambd: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens.

    rewards, values, mask: [B, T]. Returns (advantages [B, T], returns [B, T]) with
    returns = advantages + values and both 0 at masked positions. No normalisation.
    Masked positions are skipped rather than treated as zero-value states (verl), so
    the bootstrap after the last response token is 0 and holes in the mask are inert.
    """
    m = mask.bool()
    rewards, values = torch.where(m, rewards, 0.0), torch.where(m, values, 0.0)
    next_value = last_gae = torch.zeros_like(values[:, 0])
    reversed_adv: list[Tensor] = []
    # T is a few thousand at most and B-wide ops are cheap; a Python loop is clearer
    # than a scan and keeps autograd working if values ever carries a graph.
    for t in range(rewards.size(1) - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = torch.where(m[:, t], delta + gamma * lambd * last_gae, last_gae)
        next_value = torch.where(m[:, t], values[:, t], next_value)
        reversed_adv.append(last_gae)
    advantages = torch.where(m, torch.stack(reversed_adv[::-1], dim=1), 0.0)
    return advantages, torch.where(m, advantages + values, 0.0)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go sum_{k>=t} gamma^(k-t) r_k over unmasked tokens.

    rewards, mask: [B, T] -> [B, T]; masked positions are 0 and do not discount.
    """
    m = mask.bool()
    rewards = torch.where(m, rewards, 0.0)
    running = torch.zeros_like(rewards[:, 0])
    reversed_ret: list[Tensor] = []
    for t in range(rewards.size(1) - 1, -1, -1):
        running = torch.where(m[:, t], rewards[:, t] + gamma * running, running)
        reversed_ret.append(running)
    return torch.where(m, torch.stack(reversed_ret[::-1], dim=1), 0.0)


def token_level_rewards(
    scores: Tensor,
    kl: Tensor | None,
    mask: Tensor,
    kl_coef: float,
    reward_clip_range: tuple[float, float] | None = None,
) -> Tensor:
    """Dense per-token reward: KL penalty on every token, sequence score on the last.

    scores: [B]; kl, mask: [B, T] (kl may be None = no penalty). Returns [B, T]:
    -kl_coef * kl on response tokens plus the (clipped) score at the last index where
    mask == 1. Rows with an empty response get all zeros.
    """
    m = mask.bool()
    scores = _as_float(scores)
    dtype = scores.dtype
    if reward_clip_range is not None:
        scores = scores.clamp(reward_clip_range[0], reward_clip_range[1])
    rewards = torch.zeros(m.shape, dtype=dtype, device=scores.device)
    if kl is not None:
        rewards = torch.where(m, -kl_coef * kl.to(dtype), rewards)
    # argmax returns the first maximum, so on the flipped mask it finds the last 1.
    last_idx = m.size(1) - 1 - m.flip(1).to(torch.int64).argmax(dim=1)
    placed = torch.where(m.any(dim=1), scores, 0.0)  # an all-0 row's argmax is bogus
    return rewards.scatter_add(1, last_idx.unsqueeze(1), placed.unsqueeze(1))


def shape_group_scores(scores: Tensor, n_samples_per_prompt: int, estimator: AdvantageEstimator) -> Tensor:
    """Apply the estimator's per-prompt baseline to sequence scores.

    scores: [B] -> [B], rows grouped consecutively in groups of n = n_samples_per_prompt.
    group_norm: (r - mean_g) / (std_g + 1e-9), std unbiased (torch default), exactly as in
    OpenRLHF (verl uses 1e-6); a group of identical scores therefore maps to 0.
    dr_grpo, reinforce_baseline: r - mean_g.  rloo: r - mean of the other n-1 samples.
    reinforce, gae: unchanged.
    """
    check_choice("advantage estimator", estimator, ADVANTAGE_ESTIMATORS)
    n = n_samples_per_prompt
    if n < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1, got {n}")
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [B], got shape {tuple(scores.shape)}")
    b = scores.numel()
    if b % n != 0:
        raise ValueError(
            f"batch of B={b} scores is not divisible by n_samples_per_prompt={n}; "
            "rows must come in complete consecutive groups per prompt"
        )
    if estimator not in _NEEDS_GROUP:
        return scores
    if n == 1:
        raise ValueError(
            f"advantage estimator {estimator!r} uses a per-prompt group baseline and "
            "needs n_samples_per_prompt > 1 (got 1); use 'reinforce' or 'gae' for "
            "one sample per prompt"
        )
    g = _as_float(scores).reshape(-1, n)
    if estimator == "group_norm":
        out = (g - g.mean(-1, keepdim=True)) / (g.std(-1, keepdim=True) + 1e-9)
    elif estimator == "rloo":
        # r - (sum - r)/(n-1) rearranged to avoid a second pass.
        out = (g * n - g.sum(-1, keepdim=True)) / (n - 1)
    else:
        out = g - g.mean(-1, keepdim=True)
    return out.reshape(-1)


def effective_gamma(estimator: AdvantageEstimator, gamma: float) -> float:
    """The discount actually used: 1.0 for the group-baseline estimators (OpenRLHF forces it)."""
    return 1.0 if estimator in GAMMA_ONE_ESTIMATORS else gamma


def gamma_override_warning(estimator: AdvantageEstimator, gamma: float) -> str | None:
    """A one-line warning when --gamma is overridden for this estimator, else None."""
    if effective_gamma(estimator, gamma) == gamma:
        return None
    return (
        f"--gamma {gamma} is ignored for --advantage_estimator {estimator}: group-baseline estimators "
        "use gamma = 1.0 (as OpenRLHF does)"
    )


def compute_advantages(
    estimator: AdvantageEstimator,
    scores: Tensor,
    mask: Tensor,
    *,
    n_samples_per_prompt: int,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
    reward_clip_range: tuple[float, float] | None = None,
    std_norm: bool = True,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns for one rollout batch.

    scores: [B]; mask, kl, values: [B, T]. Returns (advantages [B, T], returns [B, T]),
    both 0 at masked positions.
    gae: critic-based; advantages whitened over masked tokens, returns are GAE targets.
    group estimators: scores shaped per group, KL added per token, returns = discounted
    reward-to-go and advantages = returns; gae / reinforce / reinforce_baseline are then
    whitened (REINFORCE++), or only mean-centred with std_norm=False. group_norm, dr_grpo,
    rloo and reinforce_baseline always use gamma = 1 (effective_gamma, as OpenRLHF).
    reward_clip_range applies to the *shaped* scores, as in OpenRLHF. Whitening is over
    this batch only: callers that shard a rollout across ranks and want global statistics
    must whiten themselves.
    """
    check_choice("advantage estimator", estimator, ADVANTAGE_ESTIMATORS)
    if estimator == "gae":
        if values is None:
            raise ValueError("advantage estimator 'gae' needs critic values, got values=None")
        rewards = token_level_rewards(scores, kl, mask, kl_coef, reward_clip_range)
        advantages, returns = compute_gae(rewards, values.to(rewards.dtype), mask, gamma, lambd)
        return masked_whiten(advantages, mask, divide_std=std_norm), returns
    shaped = shape_group_scores(scores, n_samples_per_prompt, estimator)
    rewards = token_level_rewards(shaped, kl, mask, kl_coef, reward_clip_range)
    returns = discounted_returns(rewards, mask, effective_gamma(estimator, gamma))
    if estimator in _WHITENED:
        advantages = masked_whiten(returns, mask, divide_std=std_norm)
    else:
        advantages = returns.clone()
    return advantages, returns


@dataclass
class KLControllerState:
    """Everything needed to resume a KL controller exactly (target/horizon are config)."""

    value: float


class _KLControllerBase:
    value: float

    def state(self) -> KLControllerState:
        return KLControllerState(value=self.value)

    def load_state(self, state: KLControllerState | Mapping[str, float]) -> None:
        self.value = float(state["value"] if isinstance(state, Mapping) else state.value)


class FixedKLController(_KLControllerBase):
    """Constant KL coefficient; load_state still restores it so resume is exact."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps


class AdaptiveKLController(_KLControllerBase):
    """Proportional controller steering observed KL towards ``target`` (Ziegler et al. 2019).

    The error is clipped to +-20% so one outlier batch cannot swing the coefficient,
    and scaled by n_steps/horizon so the adaptation speed is independent of batch size.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got target={target}, horizon={horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def make_kl_controller(
    init_kl_coef: float, kl_target: float | None, kl_horizon: int
) -> FixedKLController | AdaptiveKLController:
    """Adaptive controller when a KL target is given, otherwise a fixed coefficient."""
    if kl_target is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, kl_target, kl_horizon)


# ---- running moments ---------------------------------------------------------------------------------------------
# Running mean/std of scores for --running_reward_norm (state saved with checkpoints).


@dataclass
class RunningMoments:
    count: float = 0.0
    mean: float = 0.0
    m2: float = 0.0  # sum of squared deviations (Chan et al. parallel update)

    def update(self, x: torch.Tensor) -> None:
        """Fold a batch [B] into the running statistics."""
        n = float(x.numel())
        if n == 0:
            return
        batch_mean = float(x.double().mean())
        batch_m2 = float(((x.double() - batch_mean) ** 2).sum())
        delta = batch_mean - self.mean
        total = self.count + n
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return (self.m2 / self.count) ** 0.5 if self.count > 1 else 1.0

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / (self.std + 1e-8)


# ---- reward shaping ----------------------------------------------------------------------------------------------
# Reward shaping applied to sequence scores before the advantages (OpenRLHF 0.11 semantics):
# DAPO's overlong penalty, ProRL's stop-properly penalty, and DAPO's dynamic filtering of prompt groups.
#
# Pure tensor functions; shapes in each docstring ([B] = one value per sequence).


def overlong_penalty(response_len: Tensor, max_new_tokens: int, buffer_len: int, penalty_factor: float) -> Tensor:
    """DAPO overlong penalty to ADD to each sequence's reward: [B] lengths -> [B].

    A response longer than max_new_tokens - buffer_len loses
    min(len - (max_new_tokens - buffer_len), buffer_len) / buffer_len * penalty_factor,
    i.e. a linear ramp from 0 to -penalty_factor over the last buffer_len tokens
    (OpenRLHF length_penalty.py, apply_overlong_penalty). Shorter responses get 0.
    """
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(f"overlong buffer_len must be in (0, max_new_tokens={max_new_tokens}], got {buffer_len}")
    exceed = (response_len.to(torch.float64) - (max_new_tokens - buffer_len)).clamp(max=float(buffer_len))
    return torch.where(exceed > 0, -exceed / buffer_len * penalty_factor, 0.0)


def stop_properly_penalty(rewards: Tensor, truncated: Tensor, coef: float) -> Tensor:
    """ProRL penalty for responses cut off by the length limit: [B], [B] bool -> [B].

    coef in [0, 1] scales a truncated response's reward by coef; coef < 0 replaces it by
    coef (OpenRLHF length_penalty.py, apply_stop_properly_penalty). Others are unchanged.
    """
    if coef > 1:
        raise ValueError(f"stop_properly_penalty_coef must be in [0, 1] or negative, got {coef}")
    penalised = torch.full_like(rewards, coef) if coef < 0 else rewards * coef
    return torch.where(truncated.bool(), penalised, rewards)


def truncated_rows(responses: Tensor, response_len: Tensor, max_new_tokens: int, end_ids: tuple[int, ...]) -> Tensor:
    """Which responses were cut off by the length limit: [B, r] ids, [B] lengths -> [B] bool.

    responses are right-padded response ids (the ending token kept). A response is truncated when it
    reached max_new_tokens and its last token is none of `end_ids` (EOS and the model's other stop ids):
    vLLM's finish_reason == "length", which OpenRLHF's stop-properly penalty reads.
    """
    last = responses.gather(1, (response_len.long() - 1).clamp_min(0).unsqueeze(1)).squeeze(1)
    return cut_by_length(last, response_len, max_new_tokens, end_ids)


def cut_by_length(last_token: Tensor, response_len: Tensor, max_new_tokens: int, end_ids: tuple[int, ...]) -> Tensor:
    """The truncation rule itself: [B] last response token, [B] lengths -> [B] bool (reached the limit, and the
    last token ends no response)."""
    ends = torch.tensor(end_ids, dtype=last_token.dtype, device=last_token.device)
    return (response_len >= max_new_tokens) & ~torch.isin(last_token, ends)


def dynamic_filter_keep(scores: Tensor, n_samples_per_prompt: int, reward_range: tuple[float, float]) -> Tensor:
    """Which rows survive DAPO dynamic filtering: [B] scores -> [B] bool.

    A prompt group (n consecutive rows) is kept when low < mean(scores of the group) < high,
    strictly, as OpenRLHF's samples_generator does: with 0/1 rewards and the default range
    (0, 1) this drops the groups that are all wrong or all right (zero group advantage).
    """
    n = n_samples_per_prompt
    if scores.dim() != 1 or scores.numel() % n:
        raise ValueError(
            f"scores must be [B] with B divisible by n_samples_per_prompt={n}, got shape {tuple(scores.shape)}"
        )
    low, high = reward_range
    group_mean = (scores if scores.is_floating_point() else scores.float()).reshape(-1, n).mean(-1)
    keep = (group_mean > low) & (group_mean < high)
    return keep.repeat_interleave(n)


# ---- on-policy distillation --------------------------------------------------------------------------------------
# A frozen teacher scores the policy's own samples; the per-token divergence of the sampled token's log-probs is the
# signal (Thinking Machines' on-policy distillation, slime --use-opd, verl's distillation, prime-rl's opd): the KL
# estimates above of the student against the teacher (k1 = log pi_student - log pi_teacher, one sample of the reverse
# KL; k2; k3 = verl's low_var_kl), bounded to [-10, 10] as every rlrun KL estimate (verl's examples clamp at 10 too).


def distilled_advantages(advantages: Tensor, divergence: Tensor, mask: Tensor, coef: float) -> Tensor:
    """advantages - coef * divergence on response tokens: [B, T] -> [B, T]. Added after the estimator and its
    whitening and never through the returns, so each token's teacher term stays at its own position (a discount of
    0, as Thinking Machines' and slime's on-policy distillation; reward-to-go would sum later tokens' terms in)."""
    return torch.where(mask.bool(), advantages - coef * divergence, 0.0)
