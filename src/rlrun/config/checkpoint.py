"""The saving sections: where the trained model and the resumable checkpoints go (every trainer: `SavingConfig`), and
rlrun.ppo's extra exports and OpenRLHF checkpoints (`CheckpointConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlrun.config.fields import opt, positive
from rlrun.runtime.errors import ConfigError


@dataclass
class SavingConfig:
    """Saving and resuming (every trainer)."""

    save_path: str = opt("./ckpt", "The trained model (HF format) and the default metrics file go here.")
    save_steps: int = opt(-1, "Save a checkpoint every N steps (-1: never).")
    load_checkpoint: bool = opt(False, "Resume from the newest complete checkpoint in --ckpt_path.")
    max_ckpt_num: int = opt(3, "Keep this run's newest N checkpoints (another run's are never pruned).")
    overwrite_checkpoints: bool = opt(
        False,
        "Start a new run in a --ckpt_path that holds another run's checkpoints, "
        "deleting them once this run has saved its first one. Without it (and "
        "without --load_checkpoint) such a run stops at start-up.",
    )
    save_merged: bool = opt(
        False,
        "With --lora_rank: besides the adapter (PEFT's layout) in --save_path, write the "
        "merged model (base + adapter, plain HF format) to <save_path>/merged.",
    )
    export_nonfinite: bool = opt(
        False,
        "Export the trained model even when a weight is NaN/inf (by default the export stops, naming the tensor).",
    )
    ckpt_path: str = opt("./ckpt/checkpoints", "Directory of resumable checkpoints.")  # each trainer's own default

    def check(self) -> None:
        if self.save_steps == 0 or self.save_steps < -1:
            raise ConfigError(f"--save_steps must be a positive number of steps or -1 (never), got {self.save_steps}")
        positive("max_ckpt_num", self.max_ckpt_num)


@dataclass
class CheckpointConfig(SavingConfig):
    """Saving and resuming."""

    ckpt_path: str = opt("./ckpt/checkpoints_ppo", "Directory of resumable checkpoints.")
    save_hf_ckpt: bool = opt(False, "Also save the policy in HF format beside each checkpoint.")
    load_openrlhf_checkpoint: str | None = opt(
        None,
        "Start from an OpenRLHF DeepSpeed checkpoint: the --ckpt_path of "
        "an OpenRLHF PPO run (holding _actor/ and _critic/, tag from "
        "_actor/latest). Its fp32 weights replace the actor's (and the "
        "critic's, when this run has one and the checkpoint has "
        "_critic); the architecture still comes from "
        "--pretrain/--critic_pretrain and every tensor shape must match. "
        "Weights only: fresh optimizer and schedule, steps count from 0. "
        "--load_checkpoint still resumes from rlrun's own newer "
        "checkpoint when one exists. Offline alternative: python -m "
        "rlrun.compat.openrlhf_checkpoint.",
        metavar="DIR",
    )
