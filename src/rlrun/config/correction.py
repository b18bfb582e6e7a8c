"""The rollout-correction section (rlrun.ppo): the engine/actor log-prob mismatch correction as each peer spells it,
OpenRLHF 0.9.4-0.11.0 (--enable_vllm_is_correction), OpenRLHF 0.11.2 (--is_correction_*) and verl
(--rollout_correction PRESET or --rollout_is/--rollout_rs/--rollout_bypass). rlrun.compat.correction resolves them,
once, at planning, into rlrun's one setting (rlrun.algo.rollout_correction.RolloutCorrection); nothing past the plan
reads these fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlrun.config.fields import opt


@dataclass
class CorrectionConfig:
    """The rollout correction, in the peers' spellings (resolved by rlrun.compat.correction)."""

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

    def check(self) -> None:
        """Checked with the policy loss it corrects, where the spellings are resolved (rlrun.compat.correction)."""
