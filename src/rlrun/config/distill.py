"""The on-policy distillation section (rlrun.ppo): the teacher and how its signal trains the policy
(rlrun.algo.algorithms' distillation signal, the actor's distillation loss)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlrun.config.fields import opt, positive
from rlrun.runtime.errors import ConfigError


@dataclass
class DistillConfig:
    """On-policy distillation (--teacher_pretrain)."""

    teacher_pretrain: str | None = opt(
        None,
        "On-policy distillation: a frozen teacher (HF directory or hub id, the policy's tokenizer) scores the "
        "policy's own samples and the per-token reverse KL to it trains the policy (--teacher_kl_*); laid out like "
        "the reference (--teacher_num_nodes/--teacher_num_gpus_per_node, --colocate_actor_teacher).",
    )
    teacher_kl_coef: float = opt(
        1.0,
        "--teacher_pretrain: weight of the teacher signal: with --teacher_kl_loss false each token's advantage gets "
        "-coef * D (D: --teacher_kl_estimator of log pi_old - log pi_teacher; Thinking Machines, slime --opd-kl-coef, "
        "verl's policy-gradient OPD); with true, coef * D(log pi - log pi_teacher) joins the loss (verl's GKD OPD).",
    )
    teacher_kl_estimator: Literal["k1", "k2", "k3"] = opt(
        "k1", "The per-token divergence to the teacher (k1 = log-ratio: the reverse KL's sample; k2, k3 as for the KL)."
    )
    teacher_kl_loss: bool = opt(
        False, "Backpropagate the divergence to the teacher as a loss term instead of adding it to the advantages."
    )
    teacher_kl_clamp: float | None = opt(
        None, "Clamp each token's divergence to [-C, C] before use (verl's loss_max_clamp). Unset: no clamp."
    )
    teacher_temperature: float = opt(1.0, "The teacher's logits are divided by this (verl forces 1).")
    distill_task_reward: bool = opt(
        True,
        "--teacher_pretrain: also learn from the reward (false: only from the teacher; the reward is still computed "
        "and logged; verl's use_task_rewards).",
    )

    @property
    def on(self) -> bool:
        """A teacher scores the rollouts."""
        return self.teacher_pretrain is not None

    def check(self) -> None:
        if not self.on:
            return
        if self.teacher_kl_coef <= 0:
            raise ConfigError(
                f"--teacher_kl_coef must be > 0 with --teacher_pretrain, got {self.teacher_kl_coef}; to train without "
                "the teacher, drop --teacher_pretrain"
            )
        positive("teacher_temperature", self.teacher_temperature)
        positive("teacher_kl_clamp", self.teacher_kl_clamp, allow_none=True)
        if self.teacher_kl_loss and self.teacher_kl_estimator == "k1":
            raise ConfigError(
                "--teacher_kl_loss with --teacher_kl_estimator k1: the gradient of log pi - log pi_teacher does not "
                "depend on the teacher; use k2 or k3 as the loss (verl's GKD default is k3), or the policy-gradient "
                "form (drop --teacher_kl_loss)"
            )
