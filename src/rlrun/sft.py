"""Entry point: `torchrun -m rlrun.sft ...` (or srun / python): supervised fine-tuning with OpenRLHF's
train_sft flags. The loss is the NLL of the response tokens; see rlrun.supervised."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlrun.cli.parser import CliSpec
from rlrun.compat.openrlhf_flags import SFT_DOTTED, SFT_IGNORED, SUPERVISED_RENAMED
from rlrun.config.supervised import SFTConfig, SupervisedConfig
from rlrun.launch.env import DistEnv
from rlrun.launch.failures import leave
from rlrun.plan.plan import Planned, plan_supervised
from rlrun.run.skeleton import run_trainer

if TYPE_CHECKING:
    from rlrun.supervised.assembly import Supervised

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


class SFTEntry:
    """rlrun.sft's entry (rlrun.run.skeleton.Entry): the plan first, on every rank, the trainer once it holds."""

    name = "sft"
    cli = CLI

    def plan(self, argv: Sequence[str] | None, env: DistEnv) -> Planned[SupervisedConfig]:
        return plan_supervised(argv, env, CLI)

    def trainer(self) -> Supervised[Any]:
        from rlrun.supervised.trainers import SFT  # noqa: PLC0415 - the trainer, after the plan holds (Entry)

        return SFT


def main(argv: Sequence[str] | None = None) -> int:
    return run_trainer(SFTEntry(), argv)


if __name__ == "__main__":
    leave(main())
