"""Entry point: `torchrun -m rlrun.dpo ...` (or srun / python): DPO / IPO / cDPO on preference pairs with
OpenRLHF's train_dpo flags, against a frozen reference model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlrun.cli.parser import CliSpec
from rlrun.compat.openrlhf_flags import DPO_DOTTED, DPO_IGNORED, SUPERVISED_RENAMED
from rlrun.config.supervised import DPOConfig, SupervisedConfig
from rlrun.launch.env import DistEnv
from rlrun.launch.failures import leave
from rlrun.plan.plan import Planned, plan_supervised
from rlrun.run.skeleton import run_trainer

if TYPE_CHECKING:
    from rlrun.supervised.assembly import Supervised

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


class DPOEntry:
    """rlrun.dpo's entry (rlrun.run.skeleton.Entry): the plan first, on every rank, the trainer once it holds."""

    name = "dpo"
    cli = CLI

    def plan(self, argv: Sequence[str] | None, env: DistEnv) -> Planned[SupervisedConfig]:
        return plan_supervised(argv, env, CLI)

    def trainer(self) -> Supervised[Any]:
        from rlrun.supervised.trainers import DPO  # noqa: PLC0415 - the trainer, after the plan holds (Entry)

        return DPO


def main(argv: Sequence[str] | None = None) -> int:
    return run_trainer(DPOEntry(), argv)


if __name__ == "__main__":
    leave(main())
