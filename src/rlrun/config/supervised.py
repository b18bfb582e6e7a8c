"""The typed configuration trees of `rlrun.sft`, `rlrun.rm` and `rlrun.dpo`.

Each trainer's root config is built from the sections every trainer shares (model, optimisation,
templates, saving, tracking, runtime: each defined once in its own module of rlrun.config) plus its own data and loss
fields; the command line is generated from it exactly as for PPO (rlrun.cli.parser).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlrun.config.checkpoint import SavingConfig
from rlrun.config.data import TemplateConfig
from rlrun.config.fields import opt, positive
from rlrun.config.model import PretrainedConfig
from rlrun.config.runtime import RuntimeConfig
from rlrun.config.tracking import TrackingConfig
from rlrun.config.training import OptimConfig
from rlrun.runtime.errors import ConfigError


@dataclass
class SupervisedTrainConfig(OptimConfig):
    """Batch sizes, schedule, optimisation."""

    learning_rate: float = opt(5e-6, "Learning rate (defaults as OpenRLHF's: SFT 5e-6, RM 9e-6, DPO 1e-5).")
    max_len: int = opt(
        2048, "Most tokens of one sample (prompt + response); see each trainer's --help for what is cut or dropped."
    )

    def check(self) -> None:
        super().check()
        positive("learning_rate", self.learning_rate)
        positive("max_len", self.max_len)


@dataclass
class SupervisedCheckpointConfig(SavingConfig):
    """Saving and resuming."""

    ckpt_path: str = opt(
        "./ckpt/checkpoints",
        "Directory of resumable checkpoints (defaults as OpenRLHF's: ./ckpt/checkpoints_sft, _rm, _dpo).",
    )


@dataclass
class DatasetConfig:
    """Training and evaluation data: sources as rlrun.ppo's --prompt_data (files, directories, hub ids, blends)."""

    dataset: str | None = opt(
        None,
        "Training data sources, comma-separated: each a .jsonl/.json/.parquet/.csv file, a "
        "directory (save_to_disk, or data files) or a Hugging Face Hub dataset id, optionally "
        "SOURCE@DATA_DIR. Unset: rlrun's built-in demo data for this trainer (offline runs and "
        "tests).",
    )
    dataset_probs: str | None = opt(
        None,
        "Comma-separated sampling weights, one per --dataset source: interleave them "
        "(seeded by --seed, until every source is exhausted) instead of concatenating.",
    )
    dataset_split: str = opt("train", "Split of each --dataset source.")
    eval_dataset: str | None = opt(
        None, "Evaluation data, same format and keys as --dataset (metrics logged as eval/*)."
    )
    eval_split: str = opt("train", "Split of each --eval_dataset source.")
    tokenizer_chat_template: str | None = opt(
        None, "A Jinja chat template replacing the tokenizer's own (with --apply_chat_template)."
    )

    def check(self) -> None:
        """Nothing to check alone (the trainer needs --dataset: rlrun.plan.checks.check_supervised says so, naming
        the trainer)."""


@dataclass
class SFTDataConfig(DatasetConfig):
    """Training and evaluation data (prompt -> response records)."""

    input_key: str = opt(
        "input", "Field holding the prompt (a string, or a list of chat messages with --apply_chat_template)."
    )
    output_key: str | None = opt(
        None,
        "Field holding the response. Unset: the record's --input_key field holds whole "
        "chat conversations "
        "(--apply_chat_template) or plain text (--pretrain_mode).",
    )
    pretrain_mode: bool = opt(False, "Train on every token of the text (no prompt masking), as continued pretraining.")


@dataclass
class PairDataConfig(DatasetConfig):
    """Training and evaluation data (preference pairs)."""

    prompt_key: str | None = opt(
        None,
        "Field holding the prompt. Unset: the prompt is the chosen/rejected "
        "conversations' shared "
        "beginning (chat messages) or empty (plain text).",
    )
    chosen_key: str = opt("chosen", "Field holding the preferred response (a string or chat messages).")
    rejected_key: str = opt("rejected", "Field holding the dispreferred response.")


@dataclass
class SFTLossConfig:
    """SFT loss."""

    aux_loss_coef: float = opt(
        0.0,
        "MoE policies: weight of the load-balancing loss added to the NLL (transformers' aux_loss over the "
        "micro-batch's real tokens; OpenRLHF's --aux_loss_coef). 0: none.",
    )

    def check(self) -> None:
        """--aux_loss_coef is checked with the policy it needs (a MoE one) when the model is read."""


@dataclass
class RMLossConfig:
    """Reward-model loss."""

    loss: Literal["sigmoid", "logexpsigmoid"] = opt(
        "sigmoid", "Pairwise loss: -log sigmoid(chosen - rejected), or log(1 + exp(rejected - chosen))."
    )
    margin_loss: bool = opt(
        False,
        "sigmoid loss: subtract each record's 'margin' field from the reward difference (OpenRLHF's margin loss).",
    )

    def check(self) -> None:
        """Both settings are choices the command line already restricts."""


@dataclass
class DPOLossConfig:
    """DPO loss and the frozen reference model."""

    beta: float = opt(0.1, "DPO temperature beta (implicit reward = beta x log-ratio to the reference).")
    ipo: bool = opt(False, "IPO loss instead of DPO's sigmoid loss.")
    label_smoothing: float = opt(
        0.0, "cDPO: assumed probability that a pair's preference label is flipped (0 <= eps < 0.5)."
    )
    nll_loss_coef: float = opt(0.0, "Add this x the NLL of the chosen responses (Llama 3.1's DPO regulariser).")
    ref_pretrain: str | None = opt(
        None,
        "Reference model directory. Unset: the initial policy (--pretrain); with "
        "--lora_rank "
        "(unset or --pretrain itself) the policy's base with its adapters disabled, no "
        "copy.",
    )
    ref_offload: bool = opt(
        False,
        "Keep the reference model's parameters in CPU memory between its forward passes "
        "(GPU only; "
        "nothing to offload when --lora_rank scores the reference with the policy's base).",
    )

    def check(self) -> None:
        if not self.beta > 0:
            raise ConfigError(f"--beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(
                f"--label_smoothing must be in [0, 0.5) (the assumed label-flip probability), got "
                f"{self.label_smoothing}"
            )
        if self.nll_loss_coef < 0:
            raise ConfigError(f"--nll_loss_coef must be >= 0, got {self.nll_loss_coef}")


@dataclass
class _Shared:
    """The sections every supervised trainer has (in --help they come first, then data and loss)."""

    model: PretrainedConfig = field(default_factory=PretrainedConfig)
    template: TemplateConfig = field(default_factory=TemplateConfig)
    train: SupervisedTrainConfig = field(default_factory=SupervisedTrainConfig)
    checkpoint: SupervisedCheckpointConfig = field(default_factory=SupervisedCheckpointConfig)
    logging: TrackingConfig = field(default_factory=TrackingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


@dataclass
class SFTConfig(_Shared):
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    loss: SFTLossConfig = field(default_factory=SFTLossConfig)


@dataclass
class RMConfig(_Shared):
    data: PairDataConfig = field(default_factory=PairDataConfig)
    loss: RMLossConfig = field(default_factory=RMLossConfig)


@dataclass
class DPOConfig(_Shared):
    data: PairDataConfig = field(default_factory=PairDataConfig)
    loss: DPOLossConfig = field(default_factory=DPOLossConfig)


SupervisedConfig = SFTConfig | RMConfig | DPOConfig
