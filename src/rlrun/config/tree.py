"""rlrun.ppo's config tree: its sections composed (each defined, with its help texts, by its owner's module in
rlrun.config), and what every trainer's root config has (`RootConfig`).

Sources, later wins: dataclass defaults < YAML file (``--config x.yaml``) < CLI flags. Every field is a flag of the
same name (OpenRLHF's ``train_ppo_ray`` names where one exists), so a field is defined exactly once; the supervised
trainers' trees are in ``rlrun.config.supervised``. ``rlrun.cli.parser`` builds the parser from it, through
``rlrun.config.fields``. A component receives its own section; the properties that need two sections are on
``Config``.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field

from rlrun.config.agent import AgentConfig
from rlrun.config.algorithm import AlgorithmConfig
from rlrun.config.checkpoint import CheckpointConfig, SavingConfig
from rlrun.config.correction import CorrectionConfig
from rlrun.config.critic import CriticConfig
from rlrun.config.data import DataConfig, TemplateConfig
from rlrun.config.distill import DistillConfig
from rlrun.config.evaluation import EvalConfig
from rlrun.config.generation import GenerationConfig
from rlrun.config.model import PretrainedConfig
from rlrun.config.resources import ResourceConfig
from rlrun.config.reward import RewardConfig
from rlrun.config.runtime import RuntimeConfig
from rlrun.config.tracking import TrackingConfig
from rlrun.config.training import OptimConfig, TrainConfig
from rlrun.config.vision import VisionConfig


@dataclass
class Config:
    """rlrun.ppo's settings: one section per component that owns them (its --help groups, its YAML sections)."""

    model: PretrainedConfig = field(default_factory=PretrainedConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    template: TemplateConfig = field(default_factory=TemplateConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: TrackingConfig = field(default_factory=TrackingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    @property
    def ref_is_actor_base(self) -> bool:
        """LoRA with a KL term: the actor's own weights with the adapters disabled are the reference (verl does this),
        so the layout has no reference role and no copy of the model is held for it."""
        return self.algo.needs_ref and self.model.lora_rank > 0

    @property
    def distills_alone(self) -> bool:
        """On-policy distillation without a reward: --teacher_pretrain with --distill_task_reward false."""
        return self.distill.on and not self.distill.distill_task_reward

    @property
    def scores_nothing(self) -> bool:
        """Pure distillation with no reward source on the user's model or data: every sample scores 0 (on the demo's
        own prompts and model the demo rule still scores, logged but not learned from)."""
        demo = self.model.pretrain is None and self.data.prompt_data is None
        return self.distills_alone and not self.reward.sources() and not self.agent.multi_turn and not demo

    @property
    def reward_call_timeout(self) -> float:
        """The bound on one reward-function call: --reward_timeout, or 0.8 x --dist_timeout."""
        return self.reward.reward_timeout if self.reward.reward_timeout is not None else 0.8 * self.runtime.dist_timeout


# Fields whose section changed when each component came to own its settings (issue 61): a YAML file written before,
# nested by the old sections (a run's config.yaml, the recipes users copied), still names them there.
FORMER_SECTIONS: dict[str, str] = {
    **dict.fromkeys(
        (
            "reward_pretrain",
            "remote_rm_url",
            "remote_rm_timeout",
            "remote_rm_retries",
            "compute_score",
            "compute_score_name",
            "reward_workers",
            "reward_timeout",
            "teacher_pretrain",
            "critic_pretrain",
            "freeze_visual_encoder",
            "freeze_prefix",
        ),
        "model",
    ),
    **dict.fromkeys(
        (
            "teacher_kl_coef",
            "teacher_kl_estimator",
            "teacher_kl_loss",
            "teacher_kl_clamp",
            "teacher_temperature",
            "distill_task_reward",
            "value_clip",
            "is_correction_level",
            "is_correction_mode",
            "is_correction_gating",
            "is_correction_threshold",
            "enable_vllm_is_correction",
            "vllm_is_correction_type",
            "rollout_correction",
            "rollout_is",
            "rollout_is_threshold",
            "rollout_is_batch_normalize",
            "rollout_rs",
            "rollout_rs_threshold",
            "rollout_bypass",
            "rollout_bypass_loss",
        ),
        "algo",
    ),
    "critic_learning_rate": "train",
    "save_value_network": "checkpoint",
    **dict.fromkeys(
        ("image_key", "max_images_per_prompt", "min_pixels", "max_pixels", "input_template", "apply_chat_template"),
        "data",
    ),
    **dict.fromkeys(("eval_dataset", "eval_split", "eval_temperature", "eval_n_samples_per_prompt"), "logging"),
}


class RootConfig(typing.Protocol):
    """What every trainer's root config has (PPO's Config, rlrun.config.supervised's configs): read-only, so that each
    trainer's own subclasses of these sections fit."""

    @property
    def model(self) -> PretrainedConfig: ...

    @property
    def template(self) -> TemplateConfig: ...

    @property
    def train(self) -> OptimConfig: ...

    @property
    def checkpoint(self) -> SavingConfig: ...

    @property
    def logging(self) -> TrackingConfig: ...

    @property
    def runtime(self) -> RuntimeConfig: ...
