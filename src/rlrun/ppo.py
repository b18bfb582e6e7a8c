"""Entry point: `torchrun -m rlrun.ppo ...`, `srun python -m rlrun.ppo ...` or `python -m rlrun.ppo ...`.

PPO, GRPO, RLOO and REINFORCE++ with OpenRLHF's train_ppo_ray flags (and verl's overrides): the trainer is
rlrun.rl.assembly.PPO, its step rlrun.rl.trainer; rlrun.run.skeleton runs it from the command line to teardown.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlrun.launch.failures import leave
from rlrun.rl.assembly import PPO
from rlrun.run.skeleton import run_trainer


def main(argv: Sequence[str] | None = None) -> int:
    return run_trainer(PPO(), argv)


if __name__ == "__main__":
    leave(main())
