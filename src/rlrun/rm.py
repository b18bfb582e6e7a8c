"""Entry point: `torchrun -m rlrun.rm ...` (or srun / python): reward-model training on preference pairs with
OpenRLHF's train_rm flags; the saved model is what `rlrun.ppo --reward_pretrain` reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from rlrun.cli.parser import CliSpec
from rlrun.compat.openrlhf_flags import RM_DOTTED, RM_IGNORED, SUPERVISED_RENAMED
from rlrun.config.supervised import DPOConfig, RMConfig
from rlrun.data.sources import DataSpec
from rlrun.launch.failures import leave
from rlrun.models.loading import ScalarHeadModel
from rlrun.plan.shapes import SupervisedJob
from rlrun.run.skeleton import run_trainer
from rlrun.supervised.assembly import BuildContext, Supervised, reward_model, trainable
from rlrun.supervised.datasets import Loaded, PairTask, Preference, load_preferences
from rlrun.supervised.tasks import RewardModelTask

CLI = CliSpec(
    prog="python -m rlrun.rm",
    description="Reward-model training (OpenRLHF train_rm flag names work).",
    config_cls=RMConfig,
    ignored=RM_IGNORED,
    dotted=RM_DOTTED,
    renamed=SUPERVISED_RENAMED,
    defaults={
        "ckpt_path": "./ckpt/checkpoints_rm",
        "learning_rate": 9e-6,
        "max_len": 512,
        "max_epochs": 1,
        "micro_train_batch_size": 1,
    },
)


def load_pairs(
    cfg: RMConfig | DPOConfig, tokenizer: PreTrainedTokenizerBase, path: str | DataSpec, task: PairTask = "reward_model"
) -> Loaded[Preference]:
    """Preference pairs with the trainer's keys (rlrun.rm, and rlrun.dpo with task "dpo")."""
    d = cfg.data
    return load_preferences(
        path,
        tokenizer,
        prompt_key=d.prompt_key,
        chosen_key=d.chosen_key,
        rejected_key=d.rejected_key,
        input_template=cfg.template.input_template,
        apply_chat_template=cfg.template.apply_chat_template,
        max_len=cfg.train.max_len,
        max_samples=cfg.train.max_samples,
        task=task,
    )


def _build(cfg: RMConfig, ctx: BuildContext) -> RewardModelTask:
    model, optimizer, strategy = trainable(reward_model(cfg.model, cfg.train.seed), cfg.model, cfg.train, ctx)
    return RewardModelTask(
        cast(ScalarHeadModel, model),  # reward_model()'s, wrapped: a DeepSpeed engine forwards its attributes
        optimizer,
        strategy,
        ctx.device,
        ctx.pad_id,
        cfg.train.packing_samples,
        cfg.loss.loss,
        cfg.loss.margin_loss,
        ctx.sp,
    )


TRAINER: Supervised[Any] = Supervised(
    CLI, load_pairs, _build, SupervisedJob(pairs=True, scalar=True), eval_from_train=0.01
)


def main(argv: Sequence[str] | None = None) -> int:
    return run_trainer(TRAINER, argv)


if __name__ == "__main__":
    leave(main())
