"""Entry point: `torchrun -m rlrun.sft ...` (or srun / python): supervised fine-tuning with OpenRLHF's
train_sft flags. The loss is the NLL of the response tokens; see rlrun.supervised."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlrun.cli.parser import CliSpec
from rlrun.compat.openrlhf_flags import SFT_DOTTED, SFT_IGNORED, SUPERVISED_RENAMED
from rlrun.config.supervised import SFTConfig
from rlrun.data.sources import DataSpec
from rlrun.launch.failures import leave
from rlrun.models.loading import load_model_config, unfilled_policy
from rlrun.plan.generation import check_aux_loss
from rlrun.plan.shapes import SupervisedJob
from rlrun.run.skeleton import run_trainer
from rlrun.supervised.assembly import BuildContext, Supervised, trainable
from rlrun.supervised.datasets import Completion, Loaded, load_completions
from rlrun.supervised.tasks import SFTTask

CLI = CliSpec(
    prog="python -m rlrun.sft",
    description="Supervised fine-tuning (OpenRLHF train_sft flag names work).",
    config_cls=SFTConfig,
    ignored=SFT_IGNORED,
    dotted=SFT_DOTTED,
    renamed=SUPERVISED_RENAMED,
    defaults={
        "ckpt_path": "./ckpt/checkpoints_sft",
        "learning_rate": 5e-6,
        "max_len": 2048,
        "max_epochs": 2,
        "micro_train_batch_size": 8,
        "input_template": "User: {}\nAssistant: ",
    },
)


def _load(cfg: SFTConfig, tokenizer: PreTrainedTokenizerBase, path: str | DataSpec) -> Loaded[Completion]:
    d = cfg.data
    return load_completions(
        path,
        tokenizer,
        input_key=d.input_key,
        output_key=d.output_key,
        input_template=cfg.template.input_template,
        apply_chat_template=cfg.template.apply_chat_template,
        pretrain_mode=d.pretrain_mode,
        max_len=cfg.train.max_len,
        max_samples=cfg.train.max_samples,
    )


def _check_aux(cfg: SFTConfig) -> None:
    """--aux_loss_coef against the policy, before any weight is read (its config.json only when the flag is set)."""
    coef = cfg.loss.aux_loss_coef
    check_aux_loss(coef, load_model_config(cfg.model) if coef > 0 else None, cfg.train.sequence_parallel_size)


def _build(cfg: SFTConfig, ctx: BuildContext) -> SFTTask:
    _check_aux(cfg)
    model, optimizer, strategy = trainable(unfilled_policy(cfg.model, cfg.train.seed), cfg.model, cfg.train, ctx)
    return SFTTask(
        model,
        optimizer,
        strategy,
        ctx.device,
        ctx.pad_id,
        cfg.train.packing_samples,
        ctx.sp,
        aux_loss_coef=cfg.loss.aux_loss_coef,
    )


TRAINER: Supervised[Any] = Supervised(CLI, _load, _build, SupervisedJob())


def main(argv: Sequence[str] | None = None) -> int:
    return run_trainer(TRAINER, argv)


if __name__ == "__main__":
    leave(main())
