"""The metrics section (every trainer): logging cadence, the metrics file, wandb and TensorBoard, when evaluation
runs (rlrun.ppo's evaluation set is rlrun.config.evaluation)."""

from __future__ import annotations

from dataclasses import dataclass

from rlrun.config.fields import opt, positive


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

    def check(self) -> None:
        positive("logging_steps", self.logging_steps)
