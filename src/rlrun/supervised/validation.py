"""Checks of a supervised trainer's settings, on every rank before any process group, model or file is touched."""

from __future__ import annotations

from rlrun.config.validation import check_lora_settings, check_model_settings
from rlrun.runtime.errors import ConfigError
from rlrun.strategies.checks import check_deepspeed_install, check_deepspeed_settings
from rlrun.supervised.config import DPOConfig, SupervisedConfig


def check_supervised(cfg: SupervisedConfig, world_size: int, prog: str) -> None:
    t, d = cfg.train, cfg.data
    if d.dataset is None:
        raise ConfigError(f"{prog} needs --dataset: a local .jsonl/.json/.parquet/.csv file or saved HF datasets directory")
    for name in ("train_batch_size", "micro_train_batch_size", "max_epochs", "max_len", "max_samples", "logging_steps"):
        section = cfg.logging if name == "logging_steps" else t
        if getattr(section, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(section, name)}")
    check_model_settings(cfg.model)
    check_lora_settings(cfg.model, cfg.checkpoint)
    if t.max_steps is not None and t.max_steps < 1:
        raise ConfigError(f"--max_steps must be >= 1 (or unset), got {t.max_steps}")
    if not t.learning_rate > 0:
        raise ConfigError(f"--learning_rate must be > 0, got {t.learning_rate}")
    if t.train_batch_size % world_size:
        raise ConfigError(f"--train_batch_size {t.train_batch_size} must be a multiple of the {world_size} ranks (each rank "
                          f"takes an equal share of every batch); use e.g. {max(1, t.train_batch_size // world_size) * world_size}")
    if cfg.checkpoint.max_ckpt_num < 1:
        raise ConfigError(f"--max_ckpt_num must be >= 1, got {cfg.checkpoint.max_ckpt_num}")
    if t.strategy == "deepspeed":
        check_deepspeed_install()
        check_deepspeed_settings(t, cfg.model.bf16, saves=cfg.checkpoint.save_steps > 0 or cfg.checkpoint.load_checkpoint)
    if isinstance(cfg, DPOConfig):
        loss = cfg.loss
        if not loss.beta > 0:
            raise ConfigError(f"--beta must be > 0, got {loss.beta}")
        if not 0 <= loss.label_smoothing < 0.5:
            raise ConfigError(f"--label_smoothing must be in [0, 0.5) (the assumed label-flip probability), got {loss.label_smoothing}")
        if loss.nll_loss_coef < 0:
            raise ConfigError(f"--nll_loss_coef must be >= 0, got {loss.nll_loss_coef}")
        if loss.ref_offload and t.strategy == "fsdp" and t.zero_stage < 3:
            # Below ZeRO-3 the frozen reference is kept whole on every GPU (rlrun.strategies.fsdp), so there is no
            # sharded copy for FSDP2's CPU offload to hold: the flag would do nothing.
            raise ConfigError(f"--ref_offload needs --zero_stage 3 with --strategy fsdp (at --zero_stage {t.zero_stage} "
                              "the reference stays whole on each GPU, so nothing would be offloaded); add --zero_stage 3 "
                              "or drop --ref_offload")
