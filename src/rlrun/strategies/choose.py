"""Which strategy shards a model: the one place `--strategy` is read."""

from __future__ import annotations

import torch

from rlrun.config.model import PretrainedConfig
from rlrun.config.training import OptimConfig
from rlrun.strategies.base import Strategy
from rlrun.strategies.fsdp import FSDPStrategy


def make_strategy(
    group: torch.distributed.ProcessGroup,
    device: torch.device,
    model: PretrainedConfig,
    train: OptimConfig,
    solo: torch.distributed.ProcessGroup | None = None,
) -> Strategy:
    """The strategy for one role's models on `group` (planning/validation already checked the install,
    version and stage). `solo`: this rank's one-rank group, which DeepSpeed needs (launch/groups.py makes it)."""
    if train.strategy == "deepspeed":
        from rlrun.strategies.deepspeed import DeepSpeedStrategy, DSSettings  # noqa: PLC0415 - optional extra

        t = train
        settings = DSSettings(t.zero_stage, model.bf16, t.adam_offload, t.micro_train_batch_size, t.max_norm)
        return DeepSpeedStrategy(
            group, device, settings, gradient_checkpointing=model.gradient_checkpointing, solo_group=_required(solo)
        )
    return FSDPStrategy(
        group,
        device,
        bf16=model.bf16,
        zero_stage=train.zero_stage,
        offload=train.adam_offload,
        gradient_checkpointing=model.gradient_checkpointing,
    )


def _required(solo: torch.distributed.ProcessGroup | None) -> torch.distributed.ProcessGroup:
    if solo is None:
        raise ValueError(
            "--strategy deepspeed needs this rank's one-rank group: build the groups with "
            "rlrun.launch.groups.build_groups(..., solo=True) or solo_group()"
        )
    return solo
