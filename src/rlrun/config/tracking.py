"""The metrics sections: logging, trackers and evaluation cadence (every trainer: `TrackingConfig`), and rlrun.ppo's
evaluation set (`LoggingConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlrun.config.fields import opt


@dataclass
class TrackingConfig:
    """Metrics and trackers (every trainer)."""

    logging_steps: int = opt(1, "Log metrics every N steps.")
    eval_steps: int = opt(
        -1,
        "Evaluate on --eval_dataset every N steps. -1: rlrun.ppo never; rlrun.sft/rm/dpo at the "
        "end of every epoch, as OpenRLHF.",
    )
    eval_before_train: bool = opt(
        False, "Also evaluate before the first training step (logged as step 0), like verl's val_before_train."
    )
    metrics_file: str | None = opt(None, "JSONL metrics file (default: <save_path>/metrics.jsonl).")
    use_wandb: str | None = opt(
        None, "Log to wandb. Optional value: the API key (else WANDB_API_KEY).", secret=True, metavar="[KEY]"
    )
    wandb_org: str | None = opt(None, "wandb entity.")
    wandb_project: str | None = opt(None, "wandb project (default: rlrun_<trainer>, e.g. rlrun_ppo).")
    wandb_group: str | None = opt(None, "wandb group.")
    wandb_run_name: str | None = opt(None, "wandb run name.")
    use_tensorboard: str | None = opt(None, "TensorBoard log directory.")


@dataclass
class LoggingConfig(TrackingConfig):
    """Metrics, trackers and evaluation."""

    eval_dataset: str | None = opt(
        None,
        "Evaluation prompts, sources as for --prompt_data (same "
        "--input_key/--label_key). Needs a reward function or URL (or an agent), not "
        "--reward_pretrain.",
    )
    eval_split: str = opt("train", "Split of each --eval_dataset source (OpenRLHF's default: train).")
    eval_temperature: float = opt(0.6, "Sampling temperature for evaluation.")
    eval_n_samples_per_prompt: int = opt(4, "Responses per evaluation prompt (pass@N is logged when N > 1).")
