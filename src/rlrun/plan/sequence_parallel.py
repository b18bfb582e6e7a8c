"""Sequence parallelism in the plan: each role's size, the packing it needs, and the models that can run it."""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

from rlrun.config.model import PretrainedConfig
from rlrun.config.training import OptimConfig
from rlrun.config.tree import Config
from rlrun.launch.layout import Role
from rlrun.runtime.errors import ConfigError

T = TypeVar("T", bound=OptimConfig)


def sequence_parallel_sizes(cfg: Config) -> dict[Role, int]:
    """Each model role's sequence-parallel size: --sequence_parallel_size, the reference's and the critic's own
    where set."""
    r = cfg.resources
    sp = cfg.train.sequence_parallel_size
    return {
        Role.ACTOR: sp,
        Role.REF: r.ref_sequence_parallel_size or sp,
        Role.TEACHER: sp,
        Role.CRITIC: r.critic_sequence_parallel_size or sp,
        Role.REWARD: sp,
    }


def packed_for_sequence_parallel(train: T, largest: int, flash_attn: bool) -> tuple[T, list[str]]:
    """Sequence parallelism splits packed rows: --packing_samples is turned on with it (as OpenRLHF does for
    --ring_attn_size; verl requires use_remove_padding), and lines say so and what the attention is."""
    if largest == 1:
        return train, []
    lines = [
        f"sequence parallelism {largest}: Ulysses (an all-to-all of attention heads around each attention), not "
        "ring attention; OpenRLHF's --ring_attn_size sets its size, and --ring_head_stride is not needed"
    ]
    if flash_attn:  # OpenRLHF's ring attention needs --flash_attn, so its command lines carry it
        lines.append(
            "--flash_attn with sequence parallelism: the sequence-parallel models' attention runs PyTorch's sdpa "
            "on the gathered sequences (flash-attention's varlen kernel is not wired to Ulysses yet)"
        )
    if train.packing_samples:
        return train, lines
    return replace(train, packing_samples=True), [
        *lines,
        f"sequence parallelism (size {largest}) splits packed rows: --packing_samples is on",
    ]


def check_sequence_parallel_models(cfg: Config, sizes: dict[Role, int]) -> None:
    """Every model a sequence-parallel role runs must split its attention heads over the size (config.json-level)."""
    sources = {
        Role.ACTOR: ("pretrain", cfg.model.pretrain),
        Role.REF: ("pretrain", cfg.model.pretrain),
        Role.CRITIC: (
            "critic_pretrain",
            cfg.critic.critic_pretrain or cfg.reward.reward_pretrain or cfg.model.pretrain,
        ),
        Role.REWARD: ("reward_pretrain", cfg.reward.reward_pretrain),
        Role.TEACHER: ("teacher_pretrain", cfg.distill.teacher_pretrain),
    }
    for role, size in sizes.items():
        flag, path = sources[role]
        if path is None and role in (Role.REWARD, Role.TEACHER):
            continue
        check_sequence_parallel_model(cfg.model, flag, path, size, f"the {role.value}")


def check_sequence_parallel_model(model: PretrainedConfig, flag: str, path: str | None, size: int, who: str) -> None:
    """The model at --`flag` `path` (None: the embedded model) can split its attention heads over `size` ranks."""
    if size == 1:
        return
    # config.json through transformers: imported only by sequence-parallel runs, after the cheap checks
    from rlrun.models.architecture import is_vision_language  # noqa: PLC0415
    from rlrun.models.loading import load_model_config  # noqa: PLC0415
    from rlrun.strategies.ulysses import unsupported_reason  # noqa: PLC0415

    try:
        config = load_model_config(replace(model, pretrain=path))
    except ConfigError:
        return  # a --dry_run without the model here: planning says so
    if is_vision_language(config):
        raise ConfigError(
            f"sequence parallelism (size {size}) does not run vision-language models yet (--{flag} {path}); use "
            "--sequence_parallel_size 1"
        )
    if (problem := unsupported_reason(config, size)) is not None:
        raise ConfigError(
            f"--sequence_parallel_size {size} for {who}: --{flag} {path or '(the embedded model)'} "
            f"cannot run sequence-parallel: {problem}"
        )
