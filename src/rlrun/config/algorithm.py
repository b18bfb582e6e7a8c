"""The algorithm section (rlrun.ppo): advantages, KL, the policy loss and its parameters, reward shaping, on-policy
distillation, MoE routing, and the rollout correction in each peer's spelling (rlrun.algo has the math)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlrun.config.fields import opt

AdvantageEstimator = Literal["gae", "group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline"]
GROUP_ESTIMATORS = frozenset({"group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline"})
NEEDS_GROUPS = frozenset({"group_norm", "dr_grpo", "rloo", "reinforce_baseline"})
# rlrun.algo.policy_losses.PolicyLossType, named here so that reading a config imports no torch (a test keeps the
# two equal).
PolicyLossType = Literal[
    "ppo", "gspo", "cispo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dppo_tv", "dppo_kl", "dro"
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
        "ratio per sequence, use a small --eps_clip_low_high, e.g. 3e-4 4e-4); cispo (REINFORCE weighted by the "
        "clipped, detached ratio: verl's example clips 10 0.2); sapo (a soft sigmoid gate, --sapo_tau_pos/neg); gpg "
        "(-A log pi); clip_cov / kl_cov (covariance-selected tokens detached / penalised); geo_mean (GMPO, the "
        "--eps_clip_low_high pair as log-space bounds, e.g. 0.4 0.4); dppo_tv / dppo_kl (probability trust region, "
        "the pair as thresholds, e.g. 0.15 / 0.05; --dual_clip caps the ratio, default 3); dro (quadratic penalty, "
        "--dro_beta).",
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
    value_clip: float | None = opt(0.5, "Value clip range (unset: no clipping).")
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
    is_correction_level: Literal["off", "token", "seq"] = opt(
        "off",
        "Correct the engine/actor log-prob mismatch "
        "(OpenRLHF 0.11 "
        "--algo.advantage.is_correction_level; needs "
        "--generation_backend vllm): gate each token, or "
        "each sequence's mean, on the statistic below.",
    )
    is_correction_mode: Literal["mask", "clip"] = opt(
        "mask",
        "mask: drop units outside the threshold (survivors keep "
        "their weight pi_train/pi_rollout); clip: clamp the "
        "token weight into it (token level, ratio gating).",
    )
    is_correction_gating: Literal["ratio", "binary_kl", "tv"] = opt(
        "ratio",
        "Statistic the gate reads: the weight "
        "pi_train/pi_rollout itself, or the "
        "sampled token's binary KL / total "
        "variation between the two.",
    )
    is_correction_threshold: tuple[float, float] = opt(
        (0.5, 5.0),
        "LOW HIGH bounds of the gated statistic (0 HIGH for an upper bound only, required for binary_kl/tv).",
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
    teacher_kl_coef: float = opt(
        1.0,
        "--teacher_pretrain: weight of the teacher signal: with --teacher_kl_loss false each token's advantage gets "
        "-coef * D (D: --teacher_kl_estimator of log pi_old - log pi_teacher; Thinking Machines, slime --opd-kl-coef, "
        "verl's policy-gradient OPD); with true, coef * D(log pi - log pi_teacher) joins the loss (verl's GKD OPD).",
    )
    teacher_kl_estimator: Literal["k1", "k2", "k3"] = opt(
        "k1", "The per-token divergence to the teacher (k1 = log-ratio: the reverse KL's sample; k2, k3 as for the KL)."
    )
    teacher_kl_loss: bool = opt(
        False, "Backpropagate the divergence to the teacher as a loss term instead of adding it to the advantages."
    )
    teacher_kl_clamp: float | None = opt(
        None, "Clamp each token's divergence to [-C, C] before use (verl's loss_max_clamp). Unset: no clamp."
    )
    teacher_temperature: float = opt(1.0, "The teacher's logits are divided by this (verl forces 1).")
    distill_task_reward: bool = opt(
        True,
        "--teacher_pretrain: also learn from the reward (false: only from the teacher; the reward is still computed "
        "and logged; verl's use_task_rewards).",
    )
    enable_vllm_is_correction: bool = opt(
        False,
        "OpenRLHF 0.9.4-0.11.0's correction switch (--algo.advantage.is_correction_enable): token weights "
        "pi_actor / pi_engine by --vllm_is_correction_type within --is_correction_threshold LOW HIGH.",
    )
    vllm_is_correction_type: Literal["tis", "icepop", "seq-mask-tis"] = opt(
        "tis",
        "--enable_vllm_is_correction's kind: tis clamps each token's weight, icepop zeroes those outside, "
        "seq-mask-tis zeroes whole sequences whose geometric-mean ratio is outside (= --is_correction_level "
        "token/token/seq with --is_correction_mode clip/mask/mask).",
    )
    rollout_correction: str | None = opt(
        None,
        "A verl rollout-correction preset by name (RolloutCorrectionConfig's constructors: decoupled_token_is, "
        "decoupled_seq_is, decoupled_token_icepop, decoupled_geo_rs, bypass_ppo_clip, bypass_pg_is, ...; "
        "rlrun.algo.rollout_correction.VERL_PRESETS); instead of the --rollout_is/--rollout_rs flags.",
    )
    rollout_is: Literal["off", "token", "sequence"] = opt(
        "off",
        "verl's rollout_correction.rollout_is: importance weights pi_actor / pi_engine per token, or the sequence's "
        "product on each of its tokens (needs the engine's log-probs: native or vllm).",
    )
    rollout_is_threshold: str = opt(
        "2.0",
        "--rollout_is's bound: a number truncates the weights above it (TIS); LOW_HIGH (e.g. 0.5_5.0) zeroes those "
        "outside (IcePop).",
    )
    rollout_is_batch_normalize: bool = opt(False, "Divide the --rollout_is weights by their batch mean.")
    rollout_rs: str | None = opt(
        None,
        "verl's rejection sampling: comma list of token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, "
        "seq_max_k2/k3; tokens (or sequences) whose mismatch is outside --rollout_rs_threshold leave the update.",
    )
    rollout_rs_threshold: str | None = opt(
        None, "--rollout_rs bounds, one or one per option: k1 LOW_HIGH (or HIGH: LOW = 1/HIGH), k2/k3 HIGH."
    )
    rollout_bypass: bool = opt(
        False,
        "verl's bypass_mode: the loss's old log-probs are the engine's (no actor scoring pass unless the KL "
        "penalty needs it); weights and rejections from the current policy per micro-batch.",
    )
    rollout_bypass_loss: Literal["ppo_clip", "reinforce"] = opt(
        "ppo_clip",
        "--rollout_bypass: ppo_clip (the clipped ratio against the engine; weights only logged) or reinforce "
        "(-A log pi times the --rollout_is weights).",
    )

    @property
    def needs_critic(self) -> bool:
        return self.advantage_estimator not in GROUP_ESTIMATORS

    @property
    def needs_ref(self) -> bool:
        """A KL term needs reference log-probs (from a reference model, or from the LoRA actor's base)."""
        return self.init_kl_coef > 0 or self.use_kl_loss
