"""The metrics section (every trainer): logging cadence, the metrics file, wandb and TensorBoard, the live Prometheus
endpoint and health lines, when evaluation runs (rlrun.ppo's evaluation set is rlrun.config.evaluation)."""

from __future__ import annotations

from dataclasses import dataclass

from rlrun.config.fields import opt, positive
from rlrun.runtime.errors import ConfigError


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
    metrics_port: int | None = opt(
        None,
        "Serve Prometheus metrics from rank 0 on this port while the run runs (0: any free port, named in the log): "
        "every logged number (rlrun_<key>), each rank's memory, the health warnings. Needs prometheus-client.",
        metavar="PORT",
    )
    metrics_host: str = opt("0.0.0.0", "The address --metrics_port listens on (0.0.0.0: every interface).")
    health_slow_factor: float = opt(
        3.0, "Warn once when a phase takes more than this many times its median so far (0: never)."
    )
    health_logprob_gap: float = opt(
        0.1,
        "Warn once when the engine's log-probs differ from the trainer's by more than this on average "
        "(rollout/engine_vs_actor_logprob_diff).",
    )

    def check(self) -> None:
        positive("logging_steps", self.logging_steps)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics_port must be a TCP port (0-65535; 0: any free one), got {self.metrics_port}")
        for name in ("health_slow_factor", "health_logprob_gap"):
            value = getattr(self, name)
            if not (value >= 0 and value != float("inf")):
                raise ConfigError(f"--{name} must be a finite number >= 0, got {value}")
