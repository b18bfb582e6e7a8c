"""The evaluation section (rlrun.ppo): the held-out prompts and how they are sampled (rlrun.rl.evaluation)."""

from __future__ import annotations

from dataclasses import dataclass

from rlrun.config.fields import opt
from rlrun.runtime.errors import ConfigError


@dataclass
class EvalConfig:
    """Evaluation."""

    eval_dataset: str | None = opt(
        None,
        "Evaluation prompts, sources as for --prompt_data (same "
        "--input_key/--label_key). Needs a reward function or URL (or an agent), not "
        "--reward_pretrain.",
    )
    eval_split: str = opt("train", "Split of each --eval_dataset source (OpenRLHF's default: train).")
    eval_temperature: float = opt(0.6, "Sampling temperature for evaluation.")
    eval_n_samples_per_prompt: int = opt(4, "Responses per evaluation prompt (pass@N is logged when N > 1).")

    def check(self) -> None:
        """Only with --eval_dataset (rlrun.plan.plan.check_eval says what the other settings do without it)."""
        if self.eval_dataset is None:
            return
        if self.eval_n_samples_per_prompt < 1:
            raise ConfigError(f"--eval_n_samples_per_prompt {self.eval_n_samples_per_prompt} must be >= 1")
        if self.eval_temperature <= 0:
            raise ConfigError(f"--eval_temperature {self.eval_temperature} must be > 0 (evaluation samples)")
