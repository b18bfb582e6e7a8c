"""The reward section (rlrun.ppo): where each rollout's reward comes from (a reward model, a reward function file or
URL, verl's compute_score) and the bounds on calling it (rlrun.rewards)."""

from __future__ import annotations

from dataclasses import dataclass

from rlrun.config.fields import opt, positive
from rlrun.runtime.errors import ConfigError


@dataclass
class RewardConfig:
    """Reward sources."""

    reward_pretrain: str | None = opt(
        None, "Reward model directory (sequence-classification or value-head model scoring the last token)."
    )
    remote_rm_url: str | None = opt(
        None,
        "Reward from a local Python file defining reward_func(queries, prompts, "
        "labels), or an http(s):// endpoint; 'demo' is the demo's rule. With no "
        "reward source at all only the demo runs (built-in prompts, embedded "
        "model); anything else must name one.",
    )
    remote_rm_timeout: float = opt(
        30.0, "Seconds to wait for each HTTP reward request (--remote_rm_url http(s)://...)."
    )
    remote_rm_retries: int = opt(
        3, "Attempts per HTTP reward batch (connection errors, timeouts and 5xx are retried with backoff)."
    )
    compute_score: str | None = opt(
        None,
        "verl's reward convention: a .py file defining compute_score(data_source, "
        "solution_str, ground_truth, extra_info) called per sample (a float, or a "
        "dict whose 'score' is the reward), or 'builtin' for rlrun's versions of "
        "verl's rule scores (GSM8K, MATH, DAPO/AIME, NuminaMath, Geometry3K, Search-R1 QA), chosen per prompt by its "
        "data source. The label is --label_key (verl: reward_model.ground_truth).",
    )
    compute_score_name: str = opt(
        "compute_score", "The function --compute_score calls in its file (verl's custom_reward_function.name)."
    )
    reward_workers: int | None = opt(
        None,
        "Processes scoring samples with --compute_score in parallel (1: in this "
        "process). Unset: min(8, CPU cores / processes on the node).",
    )
    reward_timeout: float | None = opt(
        None,
        "Seconds one call of a reward file's reward_func may take on one batch; "
        "past it the run fails naming the function and the batch. Unset: 0.8 x "
        "--dist_timeout (the other ranks wait that long at most).",
    )

    @property
    def needs_reward_model(self) -> bool:
        return self.reward_pretrain is not None and self.remote_rm_url is None

    @property
    def names_reward_function(self) -> bool:
        """A reward function is named (--remote_rm_url or --compute_score)."""
        return self.remote_rm_url is not None or self.compute_score is not None

    def sources(self) -> list[str]:
        """The reward sources given, as typed."""
        given = (
            ("reward_pretrain", self.reward_pretrain),
            ("remote_rm_url", self.remote_rm_url),
            ("compute_score", self.compute_score),
        )
        return [f"--{name} {value}" for name, value in given if value is not None]

    def check(self) -> None:
        positive("remote_rm_timeout", self.remote_rm_timeout)
        positive("remote_rm_retries", self.remote_rm_retries)
        positive("reward_timeout", self.reward_timeout, allow_none=True)
        positive("reward_workers", self.reward_workers, allow_none=True)
        if len(given := self.sources()) > 1:
            raise ConfigError(f"{' and '.join(given)} are all reward sources; choose one")
