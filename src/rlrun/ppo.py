"""Entry point: `torchrun -m rlrun.ppo ...`, `srun python -m rlrun.ppo ...` or `python -m rlrun.ppo ...`.

PPO, GRPO, RLOO and REINFORCE++ with OpenRLHF's train_ppo_ray flags (and verl's overrides): planned by
rlrun.plan.plan.plan_ppo, trained by rlrun.rl.assembly.PPOTrainer (the step: rlrun.rl.trainer); rlrun.run.skeleton
runs it from the command line to teardown.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from rlrun.cli.parser import PPO_CLI
from rlrun.launch.env import DistEnv
from rlrun.launch.failures import leave
from rlrun.plan.plan import PPOPlan, plan_ppo
from rlrun.run.skeleton import run_trainer

if TYPE_CHECKING:
    from rlrun.rl.assembly import PPOTrainer


class PPO:
    """rlrun.ppo's entry (rlrun.run.skeleton.Entry). Light to import: the processes a rank spawns (its vLLM engine
    child, reward workers) import this module again as their __main__ and need none of the trainer."""

    name = "ppo"
    cli = PPO_CLI

    def plan(self, argv: Sequence[str] | None, env: DistEnv) -> PPOPlan:
        return plan_ppo(argv, env)

    def trainer(self) -> PPOTrainer:
        from rlrun.rl.assembly import PPOTrainer  # noqa: PLC0415 - the trainer, after the plan holds (Entry)

        return PPOTrainer()


def main(argv: Sequence[str] | None = None) -> int:
    return run_trainer(PPO(), argv)


if __name__ == "__main__":
    leave(main())
