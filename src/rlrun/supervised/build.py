"""The models each supervised trainer trains, wrapped by the chosen strategy on the all-ranks group."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from rlrun.config.schema import OptimConfig, PretrainedConfig
from rlrun.models.loading import ScalarHeadModel, unfilled_policy, unfilled_scalar_model
from rlrun.models.weights import Unfilled
from rlrun.roles.optim import make_optimizer
from rlrun.runtime.log import get_logger
from rlrun.strategies.base import Strategy
from rlrun.strategies.choose import make_strategy
from rlrun.supervised.config import DPOConfig, SupervisedTrainConfig

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def trainable(model: nn.Module | Unfilled, source: PretrainedConfig, train: SupervisedTrainConfig, group: "ProcessGroup",
              device: torch.device, *,
              solo: "ProcessGroup | None" = None) -> tuple[nn.Module, torch.optim.Optimizer, Strategy]:
    """(wrapped model, its optimizer, the strategy that steps it)."""
    strategy = make_strategy(group, device, source, train, solo)
    wrapped, optimizer = strategy.wrap_trainable(
        model, lambda m: make_optimizer(m, train.learning_rate, train.adam_betas, train.l2))
    return wrapped, optimizer, strategy


def reward_model(source: PretrainedConfig, seed: int) -> Unfilled:
    """The model to train as a reward model, unallocated: --pretrain's body (a causal LM or a classifier) with a
    fresh scalar head, identical on every rank."""
    hf = unfilled_scalar_model(source.pretrain, source, seed, fresh_head=True)
    return Unfilled(ScalarHeadModel(hf.model), hf.weights, prefix="hf.")


def dpo_reference(cfg: DPOConfig, group: "ProcessGroup", device: torch.device, rank: int, *,
                  solo: "ProcessGroup | None" = None) -> nn.Module:
    """The frozen reference: --ref_pretrain, else the initial policy; --ref_offload keeps its parameters in CPU
    memory between forwards (FSDP2's CPU offload, GPU only)."""
    source = dataclasses.replace(cfg.model, pretrain=cfg.loss.ref_pretrain or cfg.model.pretrain)
    offload = cfg.loss.ref_offload
    log = get_logger(rank)
    if offload and device.type != "cuda":
        log.info_once("--ref_offload: parameters already live in CPU memory on CPU; nothing to offload")
    if offload and cfg.train.strategy == "deepspeed":
        log.warning_once("--ref_offload has no effect with --strategy deepspeed yet (its frozen models are ZeRO-0 "
                         "inference engines); use --strategy fsdp to offload the reference")
    ref_train: OptimConfig = dataclasses.replace(cfg.train, adam_offload=offload and cfg.train.strategy == "fsdp")
    strategy = make_strategy(group, device, source, ref_train, solo)
    return strategy.wrap(unfilled_policy(source, cfg.train.seed), trainable=False)
