"""Entry point: `torchrun -m rlrun.dpo ...` (or srun / python): DPO / IPO / cDPO on preference pairs with
OpenRLHF's train_dpo flags, against a frozen reference model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlrun.cli.parser import CliSpec
from rlrun.compat.openrlhf_flags import DPO_DOTTED, DPO_IGNORED, SUPERVISED_RENAMED
from rlrun.config.supervised import DPOConfig
from rlrun.launch.failures import leave
from rlrun.models.loading import unfilled_policy
from rlrun.plan.shapes import SupervisedJob
from rlrun.rm import load_pairs
from rlrun.run.skeleton import run_trainer
from rlrun.supervised.assembly import BuildContext, Supervised, dpo_reference, trainable
from rlrun.supervised.tasks import DPOSettings, DPOTask

CLI = CliSpec(
    prog="python -m rlrun.dpo",
    description="DPO training (OpenRLHF train_dpo flag names work).",
    config_cls=DPOConfig,
    ignored=DPO_IGNORED,
    dotted=DPO_DOTTED,
    renamed=SUPERVISED_RENAMED,
    defaults={
        "ckpt_path": "./ckpt/checkpoints_dpo",
        "learning_rate": 1e-5,
        "max_len": 512,
        "max_epochs": 1,
        "micro_train_batch_size": 8,
    },
)


def _build(cfg: DPOConfig, ctx: BuildContext) -> DPOTask:
    model, optimizer, strategy = trainable(unfilled_policy(cfg.model, cfg.train.seed), cfg.model, cfg.train, ctx)
    reference = dpo_reference(cfg.model, cfg.loss, cfg.train, ctx)
    loss = cfg.loss
    return DPOTask(
        model,
        optimizer,
        strategy,
        reference,
        ctx.device,
        ctx.pad_id,
        cfg.train.packing_samples,
        DPOSettings(loss.beta, loss.label_smoothing, loss.ipo, loss.nll_loss_coef),
        ctx.sp,
    )


TRAINER: Supervised[Any] = Supervised(
    CLI, lambda cfg, tok, path: load_pairs(cfg, tok, path, "dpo"), _build, SupervisedJob(pairs=True, reference=True)
)


def main(argv: Sequence[str] | None = None) -> int:
    return run_trainer(TRAINER, argv)


if __name__ == "__main__":
    leave(main())
