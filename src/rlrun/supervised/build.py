"""The models each supervised trainer trains, wrapped by the chosen strategy on the all-ranks group."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from rlrun.config.schema import OptimConfig, PretrainedConfig
from rlrun.models.loading import ScalarHeadModel, trained_policy, unfilled_policy, unfilled_scalar_model
from rlrun.models.adapter_pretrain import lora_settings
from rlrun.models.lora import LoraSettings, add_scalar_adapters, refuse_adapter_as_reference
from rlrun.models.weights import Unfilled
from rlrun.roles.optim import make_optimizer
from rlrun.runtime.log import get_logger
from rlrun.strategies.base import Strategy
from rlrun.strategies.choose import make_strategy
from rlrun.supervised.config import DPOConfig, SupervisedConfig, SupervisedTrainConfig

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def trainable(model: nn.Module | Unfilled, source: PretrainedConfig, train: SupervisedTrainConfig, group: "ProcessGroup",
              device: torch.device, *,
              solo: "ProcessGroup | None" = None, rank: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Strategy]:
    """(wrapped model, its optimizer, the strategy that steps it). With --lora_rank the model gets LoRA adapters
    first (`with_adapters`): the optimizer then holds the adapters (and a reward model's head) only."""
    if (lora := lora_settings(source)) is not None:
        assert isinstance(model, Unfilled), "LoRA adapters are added before the strategy fills the model"
        model = with_adapters(model, lora, source, train.seed, rank=rank)
    strategy = make_strategy(group, device, source, train, solo)
    wrapped, optimizer = strategy.wrap_trainable(
        model, lambda m: make_optimizer(m, train.learning_rate, train.adam_betas, train.l2))
    return wrapped, optimizer, strategy


def with_adapters(model: Unfilled, lora: LoraSettings, source: PretrainedConfig, seed: int, *, rank: int = 0) -> Unfilled:
    """`model` with PEFT LoRA layers on --target_modules, still unallocated. A reward model's adapters go on its
    transformer body only: its freshly initialised score head stays outside them, trained whole (a rank-r update
    of a random one-row head would not train it), and ScalarHeadModel keeps reading the body's hidden states."""
    scalar = isinstance(model.model, ScalarHeadModel)
    # a policy continues an adapter directory given as --pretrain (trained_policy); a reward model starts afresh
    adapted = add_scalar_adapters(model, lora, seed) if scalar else trained_policy(model, source, seed)
    params = list(adapted.model.parameters())  # meta tensors: counting them allocates nothing
    total, trained = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    get_logger(rank).info_once(
        f"LoRA rank {lora.rank} alpha {lora.alpha:g} on {' '.join(lora.target_modules)}: {trained:,} of {total:,} "
        f"parameters trained ({trained / max(total, 1):.2%}{', the score head whole' if scalar else ''}); the base "
        "weights stay frozen")
    return adapted


def reference_is_base(cfg: DPOConfig) -> bool:
    """DPO with --lora_rank and no other --ref_pretrain: the reference is the policy's own base (adapters disabled),
    the initial policy, so no reference copy is built (verl, TRL). A --ref_pretrain naming another model is still
    loaded as a separate frozen reference, as OpenRLHF does (it always builds one)."""
    if cfg.model.lora_rank <= 0:
        return False
    ref, pretrain = cfg.loss.ref_pretrain, cfg.model.pretrain
    return ref is None or ref == pretrain or (pretrain is not None and os.path.realpath(ref) == os.path.realpath(pretrain))


def check_lora(cfg: SupervisedConfig) -> None:
    """What LoRA asks of the supervised trainers beyond check_lora_settings, checked with the command line on
    every rank (after --pretrain is resolved to a local path), before any model is built."""
    if isinstance(cfg, DPOConfig) and reference_is_base(cfg):
        refuse_adapter_as_reference(cfg.model.pretrain, "DPO scores its reference with the policy's adapters off")


def reward_model(source: PretrainedConfig, seed: int) -> Unfilled:
    """The model to train as a reward model, unallocated: --pretrain's body (a causal LM or a classifier) with a
    fresh scalar head, identical on every rank."""
    hf = unfilled_scalar_model(source.pretrain, source, seed, fresh_head=True)
    return Unfilled(ScalarHeadModel(hf.model), hf.weights, prefix="hf.")


def dpo_reference(cfg: DPOConfig, group: "ProcessGroup", device: torch.device, rank: int, *,
                  solo: "ProcessGroup | None" = None) -> nn.Module | None:
    """The frozen reference: --ref_pretrain, else the initial policy; --ref_offload keeps its parameters in CPU
    memory between forwards (FSDP2's CPU offload, GPU only). None with LoRA (`reference_is_base`): the DPO task
    scores the reference with the policy's adapters disabled."""
    offload = cfg.loss.ref_offload
    log = get_logger(rank)
    if reference_is_base(cfg):
        log.info_once("--lora_rank: the reference is the policy's base model with its adapters disabled; no reference "
                      "copy is built" + (", so --ref_offload has nothing to offload" if offload else ""))
        return None
    # a reference built from a model of its own: never with adapters, it is not trained
    source = dataclasses.replace(cfg.model, pretrain=cfg.loss.ref_pretrain or cfg.model.pretrain, lora_rank=0)
    if cfg.model.lora_rank > 0:
        log.info_once(f"--lora_rank with --ref_pretrain {cfg.loss.ref_pretrain}: a separate frozen reference (a full "
                      "copy of that model); drop --ref_pretrain to score with the policy's base instead")
    if offload and device.type != "cuda":
        log.info_once("--ref_offload: parameters already live in CPU memory on CPU; nothing to offload")
    if offload and cfg.train.strategy == "deepspeed":
        log.warning_once("--ref_offload has no effect with --strategy deepspeed yet (its frozen models are ZeRO-0 "
                         "inference engines); use --strategy fsdp to offload the reference")
    ref_train: OptimConfig = dataclasses.replace(cfg.train, adam_offload=offload and cfg.train.strategy == "fsdp")
    strategy = make_strategy(group, device, source, ref_train, solo)
    return strategy.wrap(unfilled_policy(source, cfg.train.seed), trainable=False)
