"""The rollout correction's three spellings resolved into rlrun's one setting.

OpenRLHF 0.9.4-0.11.0 (--enable_vllm_is_correction --vllm_is_correction_type), OpenRLHF 0.11.2 (--is_correction_*)
and verl (--rollout_correction PRESET, or --rollout_is/--rollout_rs/--rollout_bypass: verl's
algorithm.rollout_correction keys) each describe the engine/actor mismatch correction; `resolve` turns whichever one
a run uses into a `RolloutCorrection` (rlrun.algo.rollout_correction), once, when the run is planned. `check`
refuses two spellings at once and settings that do not parse, naming the flags as typed.
"""

from __future__ import annotations

from rlrun.algo.rollout_correction import (
    RolloutCorrection,
    check_openrlhf,
    openrlhf_correction,
    preset,
    verl_correction,
)
from rlrun.config.algorithm import PolicyLossType
from rlrun.config.correction import CorrectionConfig
from rlrun.runtime.errors import ConfigError

# OpenRLHF 0.9.4-0.11.0's --vllm_is_correction_type as 0.11.2's (level, mode) with gating "ratio".
_OPENRLHF_TYPES = {"tis": ("token", "clip"), "icepop": ("token", "mask"), "seq-mask-tis": ("seq", "mask")}


def openrlhf_settings(c: CorrectionConfig) -> tuple[str, str, str, float, float] | None:
    """OpenRLHF's correction as 0.11.2's (level, mode, gating, low, high), from either of its spellings; None: off."""
    low, high = c.is_correction_threshold
    if c.enable_vllm_is_correction:
        level, mode = _OPENRLHF_TYPES[c.vllm_is_correction_type]
        return level, mode, "ratio", low, high
    if c.is_correction_level != "off":
        return c.is_correction_level, c.is_correction_mode, c.is_correction_gating, low, high
    return None


def resolve(c: CorrectionConfig, policy_loss_type: PolicyLossType) -> RolloutCorrection:
    """The run's rollout correction from whichever spelling it uses (`check` refuses two at once). ValueError for
    verl settings that do not parse."""
    if (openrlhf := openrlhf_settings(c)) is not None:
        if policy_loss_type == "gspo":
            # OpenRLHF's PolicyLoss takes GSPO's sequence ratio against the engine's log-probs instead of weighting.
            return RolloutCorrection(bypass=True)
        return openrlhf_correction(*openrlhf)
    if c.rollout_correction is not None:
        return preset(c.rollout_correction)
    return verl_correction(
        c.rollout_is,
        c.rollout_is_threshold,
        c.rollout_is_batch_normalize,
        c.rollout_rs,
        c.rollout_rs_threshold,
        c.rollout_bypass,
        c.rollout_bypass_loss,
    )


def check(c: CorrectionConfig, policy_loss_type: PolicyLossType) -> RolloutCorrection:
    """One spelling at a time, each valid by its own peer's rules; returns the resolved correction."""
    if c.enable_vllm_is_correction and c.is_correction_level != "off":
        raise ConfigError(
            f"--enable_vllm_is_correction (--vllm_is_correction_type {c.vllm_is_correction_type}) and "
            f"--is_correction_level {c.is_correction_level} are two releases' spellings of OpenRLHF's correction; "
            "keep one"
        )
    openrlhf = openrlhf_settings(c)
    if openrlhf is not None and (problem := check_openrlhf(*openrlhf)) is not None:
        raise ConfigError(problem)
    verl = [flag for flag in verl_flags(c) if not flag.startswith("--rollout_correction")]
    if openrlhf is not None and (verl or c.rollout_correction is not None):
        raise ConfigError(
            f"{flags(c, policy_loss_type)} (OpenRLHF's correction) and {' '.join(verl_flags(c))} (verl's) both "
            "correct the engine/actor mismatch; keep one"
        )
    if c.rollout_correction is not None and verl:
        raise ConfigError(
            f"--rollout_correction {c.rollout_correction} is a whole verl preset; drop {' '.join(verl)} or the preset"
        )
    try:
        return resolve(c, policy_loss_type)
    except ValueError as exc:
        raise ConfigError(f"{' '.join(verl_flags(c))}: {exc}") from None


def verl_flags(c: CorrectionConfig) -> list[str]:
    """verl's rollout-correction flags set to something else than off, as typed."""
    out = [f"--rollout_correction {c.rollout_correction}"] if c.rollout_correction is not None else []
    if c.rollout_is != "off":
        out.append(f"--rollout_is {c.rollout_is} --rollout_is_threshold {c.rollout_is_threshold}")
    if c.rollout_rs is not None:
        out.append(f"--rollout_rs {c.rollout_rs} --rollout_rs_threshold {c.rollout_rs_threshold}")
    if c.rollout_bypass:
        out.append(f"--rollout_bypass --rollout_bypass_loss {c.rollout_bypass_loss}")
    return out


def flags(c: CorrectionConfig, policy_loss_type: PolicyLossType) -> str:
    """The flags that turn a rollout correction on, as typed ("" when none does)."""
    if c.enable_vllm_is_correction:
        return f"--enable_vllm_is_correction --vllm_is_correction_type {c.vllm_is_correction_type}"
    if c.is_correction_level != "off":
        return f"--is_correction_level {c.is_correction_level}"
    try:
        active = resolve(c, policy_loss_type).active
    except ValueError:
        active = True  # check() names them with the reason
    return " ".join(verl_flags(c)) if active else ""
