"""Token-level helpers shared by the peer flag translators."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from typing import Literal

from rlrun.runtime.errors import ConfigError

# How many values a flag takes: a count, "*" (any number), "+" (at least one), "?" (an optional one).
Nargs = int | Literal["*", "+", "?"]

# A Hydra override: optional + / ++ / ~ prefix, a dotted key, '=' and a value (possibly empty).
_OVERRIDE = re.compile(r"^(\+\+|\+|~)?([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_0-9][A-Za-z0-9_]*)*)=(.*)$", re.S)


def split_override(token: str) -> tuple[str, str, str] | None:
    """(prefix, key, raw value) of a verl/Hydra ``key=value`` token, or None if it is not one."""
    if token.startswith("-"):
        return None
    match = _OVERRIDE.match(token)
    return (match.group(1) or "", match.group(2), match.group(3)) if match else None


def is_value(token: str) -> bool:
    """May this token be a flag's value (not a flag, not a verl override)?"""
    return not token.startswith("--") and split_override(token) is None


def take_values(argv: Sequence[str], start: int, nargs: Nargs, flag: str) -> list[str]:
    """The values of `flag` beginning at argv[start]; a missing required value is a ConfigError naming the flag."""
    if nargs == "?":
        return [argv[start]] if start < len(argv) and is_value(argv[start]) else []
    if nargs in ("*", "+"):
        end = start
        while end < len(argv) and is_value(argv[end]):
            end += 1
        if nargs == "+" and end == start:
            raise ConfigError(f"{flag} needs at least one value")
        return list(argv[start:end])
    count = int(nargs)
    values = list(argv[start : start + count])
    # A value may legitimately start with '-' (negative numbers), but never with '--'.
    if len(values) < count or any(v.startswith("--") for v in values):
        raise ConfigError(f"{flag} needs {count} value{'s' if count > 1 else ''}")
    return values


# ---- reasons ---------------------------------------------------------------------------------------------------
# Why a peer flag is accepted but has no effect (one wording per reason, shared by every flag table).

RAY_ONLY = "Ray-only: rlrun runs without Ray (torchrun/srun start the processes)"
NOT_YET = "not implemented in rlrun yet; it has no effect"
RING_HEAD_STRIDE = (
    "not needed: rlrun runs --ring_attn_size as Ulysses sequence parallelism, which exchanges all attention heads "
    "in one all-to-all per tensor"
)
LAUNCHER = "set by the launcher: torchrun/srun give every process its rank"

# Peer flags and keys whose absence changes WHAT is trained: acting as if they were not given would silently train
# something else, so each is refused at start-up with the reason (until rlrun implements it), unless its value is
# one that asks for nothing (OFF: 0, false, null, the peer's default). Keys are rlrun's classic flag names, OpenRLHF
# 0.11's dotted names and verl keys; the value is what ignoring the flag would do.
# bitsandbytes' 4-bit kernels exist on CUDA only, and the adapters on a 4-bit base (QLoRA) need their own dtype and
# weight-sync handling that rlrun does not have; refused everywhere rather than on CPU alone.
QLORA = (
    "bitsandbytes 4-bit loading is CUDA-only and rlrun does not implement QLoRA: it would load and train the "
    "full-precision model; use --lora_rank on a bf16 base model"
)
# verl's Megatron backend has its own LoRA block (model.lora.rank, Megatron-Core module names); rlrun's LoRA is PEFT
# on the Hugging Face model, set by verl's FSDP keys.
_MEGATRON_LORA = (
    "verl's Megatron-backend LoRA (model.lora.*) is not read by rlrun: it would train every weight; use "
    "actor_rollout_ref.model.lora_rank, lora_alpha and target_modules (PEFT, Hugging Face module names)"
)
CHANGES_TRAINING: dict[str, str] = {
    "load_in_4bit": QLORA,
    "actor_rollout_ref.model.lora.rank": _MEGATRON_LORA,
    "critic.model.lora.rank": _MEGATRON_LORA,
    "ptx_coef": "the pretraining (PTX) loss is not implemented in rlrun yet: it would train without it",
    "aux_loss_coef": "the MoE auxiliary loss is implemented for rlrun.ppo and rlrun.sft only: it would train "
    "without it",
    "freezing_actor_steps": "freezing the actor for the first steps is not implemented in rlrun yet: it would train "
    "the actor from step 1",
    "enable_ema": "EMA weights are not implemented in rlrun yet: it would save the trained weights, not their average",
    "value_head_prefix": "a reward/critic value head under another name is not implemented in rlrun yet: it would "
    "score with a freshly initialised head",
}
OFF = frozenset({"0", "0.0", "false", "none", "null", "-1", "value_head", "train"})  # no EMA, no LoRA, the defaults


def refused(given: list[tuple[str, str | None]], accepted: Collection[str] = ()) -> str | None:
    """The one error for the flags/keys as the user spelled them ("--load_in_4bit", "--data.image_key",
    "data.image_key"), each with its value (None: a switch), that would change what is trained; None when none
    would. `accepted`: the trainer's own fields (--aux_loss_coef is rlrun.ppo's and rlrun.sft's, refused by rm and
    dpo)."""
    hits = [
        (name, value)
        for name, value in given
        if name.removeprefix("--") in CHANGES_TRAINING
        and name.removeprefix("--") not in accepted
        and (value is None or str(value).strip().lower() not in OFF)
    ]
    if not hits:
        return None
    return (
        "; ".join(
            f"{name}{'' if value is None else ' ' + str(value)}: {CHANGES_TRAINING[name.removeprefix('--')]}"
            for name, value in dict.fromkeys(hits)
        )
        + ". Drop the flag(s) to train without them."
    )
