"""Entry point: `torchrun -m rlrun.dpo ...` (or srun / python): DPO / IPO / cDPO on preference pairs with
OpenRLHF's train_dpo flags, against a frozen reference model."""

from __future__ import annotations

from typing import Any

from rlrun.cli.parser import CliSpec
from rlrun.compat.openrlhf_supervised_flags import DPO_DOTTED, DPO_IGNORED
from rlrun.launch.failures import leave
from rlrun.models.loading import unfilled_policy
from rlrun.rl.memory_knobs import SupervisedJob
from rlrun.rl.memory_text import supervised_memory
from rlrun.rm import load_pairs
from rlrun.supervised.build import dpo_reference, trainable
from rlrun.supervised.config import DPOConfig
from rlrun.supervised.dpo_task import DPOSettings, DPOTask
from rlrun.supervised.run import BuildContext, SupervisedTrainer, main

CLI = CliSpec(prog="python -m rlrun.dpo", description="DPO training (OpenRLHF train_dpo flag names work).",
              config_cls=DPOConfig, ignored=DPO_IGNORED, dotted=DPO_DOTTED,
              defaults={"ckpt_path": "./ckpt/checkpoints_dpo", "learning_rate": 1e-5, "max_len": 512, "max_epochs": 1, "micro_train_batch_size": 8})


def _build(cfg: DPOConfig, ctx: BuildContext) -> DPOTask:
    model, optimizer, strategy = trainable(unfilled_policy(cfg.model, cfg.train.seed), cfg.model, cfg.train,
                                           ctx.group, ctx.device, solo=ctx.solo, rank=ctx.rank)
    reference = dpo_reference(cfg, ctx.group, ctx.device, ctx.rank, solo=ctx.solo)
    loss = cfg.loss
    return DPOTask(model, optimizer, strategy, reference, ctx.device, ctx.pad_id, cfg.train.packing_samples,
                   DPOSettings(loss.beta, loss.label_smoothing, loss.ipo, loss.nll_loss_coef))


TRAINER: SupervisedTrainer[Any] = SupervisedTrainer(
    CLI, lambda cfg, tok, path: load_pairs(cfg, tok, path, "dpo"), _build,
    memory_plan=supervised_memory(SupervisedJob(pairs=True, reference=True)))

if __name__ == "__main__":
    leave(main(TRAINER))
