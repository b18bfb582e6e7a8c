"""Entry point: `torchrun -m rlrun.rm ...` (or srun / python): reward-model training on preference pairs with
OpenRLHF's train_rm flags; the saved model is what `rlrun.ppo --reward_pretrain` reads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlrun.cli.parser import CliSpec
from rlrun.compat.openrlhf_flags import RM_DOTTED, RM_IGNORED, SUPERVISED_RENAMED
from rlrun.config.supervised import RMConfig, SupervisedConfig
from rlrun.launch.env import DistEnv
from rlrun.launch.failures import leave
from rlrun.plan.plan import Planned, plan_supervised
from rlrun.run.skeleton import run_trainer

if TYPE_CHECKING:
    from rlrun.supervised.assembly import Supervised

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


class RMEntry:
    """rlrun.rm's entry (rlrun.run.skeleton.Entry): the plan first, on every rank, the trainer once it holds."""

    name = "rm"
    cli = CLI

    def plan(self, argv: Sequence[str] | None, env: DistEnv) -> Planned[SupervisedConfig]:
        return plan_supervised(argv, env, CLI)

    def trainer(self) -> Supervised[Any]:
        from rlrun.supervised.trainers import RM  # noqa: PLC0415 - the trainer, after the plan holds (Entry)

        return RM


def main(argv: Sequence[str] | None = None) -> int:
    return run_trainer(RMEntry(), argv)


if __name__ == "__main__":
    leave(main())
