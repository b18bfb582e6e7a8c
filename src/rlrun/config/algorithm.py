"""The algorithm section (rlrun.ppo): advantages, KL, the policy loss and its parameters, reward shaping, on-policy
distillation, MoE routing, and the rollout correction in each peer's spelling (rlrun.algo has the math)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rlrun.config.fields import non_negative, opt, positive
from rlrun.runtime.errors import ConfigError

if TYPE_CHECKING:  # torch's; the section is read without it
    from rlrun.algo.policy_losses import PolicyLossParams

AdvantageEstimator = Literal["gae", "group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline"]
GROUP_ESTIMATORS = frozenset({"group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline"})
NEEDS_GROUPS = frozenset({"group_norm", "dr_grpo", "rloo", "reinforce_baseline"})
# rlrun.algo.policy_losses.PolicyLossType, named here so that reading a config imports no torch (a test keeps the
# two equal).
PolicyLossType = Literal[
    "ppo", "gspo", "gspo_token", "cispo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dppo_tv", "dppo_kl", "dro"
]


@dataclass
class AlgorithmConfig:
    """Advantages, KL and losses."""

    advantage_estimator: AdvantageEstimator = opt(
        "gae", "gae (PPO), group_norm (GRPO), dr_grpo, rloo, reinforce (REINFORCE++), reinforce_baseline."
    )
    init_kl_coef: float = opt(0.01, "KL coefficient (reward penalty, or loss weight with --use_kl_loss).")
    kl_target: float | None = opt(None, "Adaptive KL: target KL (unset: fixed coefficient).")
    kl_horizon: int = opt(10000, "Adaptive KL horizon.")
    kl_estimator: Literal["k1", "k2", "k3"] = opt(
        "k1", "KL estimator (Schulman's k1/k2/k3); every estimate is clamped to [-10, 10] as in OpenRLHF."
    )
    use_kl_loss: bool = opt(False, "KL as a loss term instead of a reward penalty (GRPO).")
    gamma: float = opt(
        1.0,
        "Discount factor (gae, reinforce). group_norm, dr_grpo, rloo and reinforce_baseline "
        "always use 1.0, as in OpenRLHF.",
    )
    lambd: float = opt(1.0, "GAE lambda.")
    eps_clip: float = opt(0.2, "PPO clip range.")
    eps_clip_low_high: tuple[float, float] | None = opt(
        None,
        "Asymmetric PPO clip: the ratio is clipped to [1 - LOW, "
        "1 + HIGH] (DAPO clip-higher). Unset: (eps_clip, "
        "eps_clip).",
    )
    policy_loss_type: PolicyLossType = opt(
        "ppo",
        "The policy loss (verl's policy_loss.loss_mode; rlrun.algo.policy_losses): ppo (clipped ratio); gspo (one "
        "ratio per sequence, use a small --eps_clip_low_high, e.g. 3e-4 4e-4; OpenRLHF's form); gspo_token (verl's "
        "gspo: each token's own advantage and gradient, no dual clip; verl's loss_mode=gspo); cispo (REINFORCE "
        "weighted by the clipped, detached ratio: verl's example clips 10 0.2); sapo (a soft sigmoid gate, "
        "--sapo_tau_pos/neg); gpg (-A log pi); clip_cov / kl_cov (covariance-selected tokens detached / penalised); "
        "geo_mean (GMPO, the --eps_clip_low_high pair as log-space bounds, e.g. 0.4 0.4); dppo_tv / dppo_kl "
        "(probability trust region, the pair as thresholds, e.g. 0.15 / 0.05; --dual_clip caps the ratio, default 3);"
        " dro (quadratic penalty, --dro_beta).",
    )
    sapo_tau_pos: float = opt(1.0, "sapo: the gate's temperature for tokens with a positive advantage.")
    sapo_tau_neg: float = opt(1.05, "sapo: the gate's temperature for the other tokens.")
    clip_cov_ratio: float = opt(2e-4, "clip_cov: share of a micro-batch's tokens whose gradient is detached (>= 1).")
    clip_cov_bounds: tuple[float, float] = opt(
        (1.0, 5.0), "clip_cov: LB UB, the covariance window of the tokens it may detach."
    )
    kl_cov_ratio: float = opt(2e-4, "kl_cov: share of a micro-batch's tokens given the |log-ratio| penalty (>= 1).")
    kl_cov_coef: float = opt(0.1, "kl_cov: the penalty's weight (verl's policy_loss.ppo_kl_coef).")
    dro_beta: float | None = opt(None, "dro: the weight of its (log pi - log pi_old)^2 / 2 penalty (required, > 0).")
    dual_clip: float | None = opt(
        None, "Dual-clip constant (> 1; ppo, gspo). dppo_tv / dppo_kl: the cap of the truncated ratio (unset: 3)."
    )
    normalize_reward: bool = opt(
        False,
        "As OpenRLHF: (score - mean) / std with the mean/std stored in the reward "
        "model's config.json (absent: 0/1); critic values get their model config's "
        "mean/std too. Reward functions and HTTP rewards are untouched.",
    )
    running_reward_norm: bool = opt(
        False, "rlrun: standardise every score with a running mean/std over all steps so far (kept in checkpoints)."
    )
    overlong_buffer_len: int | None = opt(
        None,
        "DAPO overlong penalty: responses longer than generate_max_len - N "
        "tokens lose up to --overlong_penalty_factor, linearly over the last "
        "N tokens. Unset: off.",
    )
    overlong_penalty_factor: float = opt(1.0, "Largest overlong penalty (reached at generate_max_len tokens).")
    stop_properly_penalty_coef: float | None = opt(
        None,
        "ProRL: rewards of responses cut off at generate_max_len "
        "without EOS are multiplied by this (in [0, 1]) or, if "
        "negative, replaced by it. Unset: off.",
    )
    dynamic_filtering: bool = opt(
        False,
        "DAPO dynamic sampling: prompt groups whose mean score is not strictly "
        "inside --dynamic_filtering_reward_range are left out of the update (rlrun "
        "keeps the batch shape and masks them out instead of re-sampling). Needs "
        "--n_samples_per_prompt > 1.",
    )
    dynamic_filtering_reward_range: tuple[float, float] = opt(
        (0.0, 1.0), "Keep a prompt group when LOW < mean score < HIGH (--dynamic_filtering)."
    )
    reward_clip_range: tuple[float, float] = opt((-10.0, 10.0), "Clip scores to this range.")
    entropy_loss_coef: float | None = opt(None, "Entropy bonus coefficient (0 logs entropy only).")
    no_advantage_std_norm: bool = opt(
        False, "gae/reinforce/reinforce_baseline: only subtract the advantage mean, do not divide by its std."
    )
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = opt(
        "token-mean", "How per-token losses are averaged."
    )

    aux_loss_coef: float = opt(
        0.0,
        "MoE policies: weight of the load-balancing loss added to the actor's (transformers' aux_loss, the "
        "Switch-Transformer form, over the micro-batch's real tokens; OpenRLHF's --aux_loss_coef). 0: none.",
    )
    router_replay: Literal["off", "R2", "R3"] = opt(
        "off",
        "MoE policies: R3 records the experts each token went through when the engine sampled it and routes the "
        "actor's and reference's forwards through the same ones (the router's probabilities still train; verl's "
        "actor_rollout_ref.actor.router_replay.mode). R2 records them in the actor's scoring pass and replays them "
        "in its training passes (any engine). off: each forward routes by itself.",
    )

    @property
    def needs_critic(self) -> bool:
        return self.advantage_estimator not in GROUP_ESTIMATORS

    @property
    def needs_ref(self) -> bool:
        """A KL term needs reference log-probs (from a reference model, or from the LoRA actor's base)."""
        return self.init_kl_coef > 0 or self.use_kl_loss

    def loss_params(self) -> PolicyLossParams:
        """--policy_loss_type's own parameters, as rlrun.algo.policy_losses takes them."""
        from rlrun.algo.policy_losses import PolicyLossParams  # noqa: PLC0415 - the section is read without torch

        return PolicyLossParams(
            self.sapo_tau_pos,
            self.sapo_tau_neg,
            self.clip_cov_ratio,
            self.clip_cov_bounds,
            self.kl_cov_ratio,
            self.kl_cov_coef,
            self.dro_beta,
        )

    def check(self) -> None:
        positive("eps_clip", self.eps_clip)
        if not 0 <= self.gamma <= 1 or not 0 <= self.lambd <= 1:
            raise ConfigError(f"--gamma and --lambd must be in [0, 1], got {self.gamma} and {self.lambd}")
        non_negative("init_kl_coef", self.init_kl_coef)
        positive("kl_target", self.kl_target, allow_none=True)
        positive("kl_horizon", self.kl_horizon)
        low, high = self.reward_clip_range
        if low >= high:
            raise ConfigError(f"--reward_clip_range needs low < high, got {low} {high}")
        if self.entropy_loss_coef is not None:
            non_negative("entropy_loss_coef", self.entropy_loss_coef)
        if self.eps_clip_low_high is not None:
            low, high = self.eps_clip_low_high
            # the PPO family clips the ratio to [1 - LOW, 1 + HIGH]; CISPO caps a weight (verl's example: LOW 10, no
            # lower clip), GMPO bounds log-ratios and DPPO probability moves, where LOW >= 1 has a meaning
            ppo_like = self.policy_loss_type in ("ppo", "gspo", "gspo_token", "clip_cov")
            if low <= 0 or high <= 0 or (ppo_like and low >= 1):
                raise ConfigError(
                    f"--eps_clip_low_high {low} {high}: needs {'0 < LOW < 1' if ppo_like else 'LOW > 0'} and HIGH > 0 "
                    f"(--policy_loss_type {self.policy_loss_type} clips the ratio to [1 - LOW, 1 + HIGH]), e.g. "
                    "--eps_clip_low_high 0.2 0.28"
                )
        low, high = self.dynamic_filtering_reward_range
        if self.dynamic_filtering and low >= high:
            raise ConfigError(
                f"--dynamic_filtering_reward_range needs LOW < HIGH, got {low} {high} (e.g. 0 1 for 0/1 rewards)"
            )
        non_negative("overlong_penalty_factor", self.overlong_penalty_factor)
        if self.stop_properly_penalty_coef is not None and self.stop_properly_penalty_coef > 1:
            raise ConfigError(
                f"--stop_properly_penalty_coef {self.stop_properly_penalty_coef}: use a value in [0, 1] "
                "(scales truncated rewards) or a negative one (replaces them)"
            )
        from rlrun.algo.policy_losses import check_params  # noqa: PLC0415 - the section is read without torch

        if (problem := check_params(self.policy_loss_type, self.dual_clip, self.loss_params())) is not None:
            flags = {"dual_clip": "--dual_clip", "dro_beta": "--dro_beta", "sapo": "--sapo_tau_pos/--sapo_tau_neg"}
            named = next((flag for key, flag in flags.items() if key in problem), "")
            raise ConfigError(
                f"--policy_loss_type {self.policy_loss_type}: {problem}" + (f"; set {named}" if named else "")
            )
