"""Entry point: `torchrun -m rlrun.ppo ...`, `srun python -m rlrun.ppo ...` or `python -m rlrun.ppo ...`.

PPO, GRPO, RLOO and REINFORCE++ with OpenRLHF's train_ppo_ray flags (and verl's overrides): the trainer is
rlrun.rl.assembly.PPO, its step rlrun.rl.trainer; rlrun.run.skeleton runs it from the command line to teardown.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    # Imported here rather than at the top: the processes a rank spawns (its vLLM engine child, reward workers) run
    # this module again as their __main__ (multiprocessing's spawn), and need none of the trainer (seconds each).
    from rlrun.rl.assembly import PPO  # noqa: PLC0415
    from rlrun.run.skeleton import run_trainer  # noqa: PLC0415

    return run_trainer(PPO(), argv)


if __name__ == "__main__":
    from rlrun.launch.failures import leave

    leave(main())
