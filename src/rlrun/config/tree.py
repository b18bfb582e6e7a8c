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
from rlrun.config.data import DataConfig
from rlrun.config.generation import GenerationConfig
from rlrun.config.model import ModelConfig, PretrainedConfig
from rlrun.config.resources import ResourceConfig
from rlrun.config.runtime import RuntimeConfig
from rlrun.config.tracking import LoggingConfig, TrackingConfig
from rlrun.config.training import OptimConfig, TrainConfig


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    @property
    def ref_is_actor_base(self) -> bool:
        """LoRA with a KL term: the actor's own weights with the adapters disabled are the reference (verl does this),
        so the layout has no reference role and no copy of the model is held for it."""
        return self.algo.needs_ref and self.model.lora_rank > 0

    @property
    def reward_call_timeout(self) -> float:
        """The bound on one reward-function call: --reward_timeout, or 0.8 x --dist_timeout."""
        return self.model.reward_timeout if self.model.reward_timeout is not None else 0.8 * self.runtime.dist_timeout


class RootConfig(typing.Protocol):
    """What every trainer's root config has (PPO's Config, rlrun.config.supervised's configs): read-only, so that each
    trainer's own subclasses of these sections fit."""

    @property
    def model(self) -> PretrainedConfig: ...

    @property
    def train(self) -> OptimConfig: ...

    @property
    def checkpoint(self) -> SavingConfig: ...

    @property
    def logging(self) -> TrackingConfig: ...

    @property
    def runtime(self) -> RuntimeConfig: ...
