"""Entry point: `torchrun -m rlrun.tinker --pretrain MODEL [--lora_rank R] [--tinker_port P] ...` (or srun /
python): scripts written with the tinker SDK train on this job's ranks (docs/tinker.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlrun.cli.parser import CliSpec
from rlrun.config.tinker import TinkerConfig
from rlrun.launch.env import DistEnv
from rlrun.launch.failures import leave
from rlrun.run.skeleton import run_trainer
from rlrun.tinker.plan import TinkerPlan, plan_tinker

if TYPE_CHECKING:
    from rlrun.tinker.assembly import TinkerTrainer

CLI = CliSpec(
    prog="python -m rlrun.tinker",
    description="Serve the Tinker training API (forward_backward, optim_step, sample, save/load) from this job.",
    config_cls=TinkerConfig,
    ignored={},
    dotted={},
    defaults={"ckpt_path": "./ckpt/tinker", "micro_train_batch_size": 8},
)


class TinkerEntry:
    """rlrun.tinker's entry (rlrun.run.skeleton.Entry)."""

    name = "tinker"
    cli = CLI

    def plan(self, argv: Sequence[str] | None, env: DistEnv) -> TinkerPlan:
        return plan_tinker(argv, env, CLI)

    def trainer(self) -> TinkerTrainer:
        from rlrun.tinker.assembly import TinkerTrainer  # noqa: PLC0415 - the trainer, after the plan holds (Entry)

        return TinkerTrainer()


def main(argv: Sequence[str] | None = None) -> int:
    return run_trainer(TinkerEntry(), argv)


if __name__ == "__main__":
    leave(main())
