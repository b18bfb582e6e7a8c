"""--async_train: the engines generate step N+1 while the learners train on step N, over the same phases as the
synchronous step (rlrun.rl.trainer).

With the engines on ranks of their own, an engine rank produces step N+1's rollouts with the weights before step N's
update while the learners (every other rank) score and train on step N, generated a step earlier; the weights sync at
the step boundary, then step N+1's batch is exchanged and held (`pending`) until the next step. That is one step
off-policy, always exactly one, and exactly resumable: a checkpoint keeps the batch in flight (`PendingRollout`).
With --partial_rollout the engines keep sequences in flight across syncs (rlrun.rl.partial_rollout) and go on with
them until the learners say they have trained (RolloutSource.signal_trained).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from rlrun.data.batching import derive_seed, seed_everything
from rlrun.rl.rollouts import StepOutputs
from rlrun.rl.trainer import Trainer
from rlrun.runtime.log import get_logger
from rlrun.runtime.phases import Phase

PENDING_FILE = "pending_rollout.pt"  # the next step's batch, generated before the save


class AsyncTrainer(Trainer):
    """The RL loop with generation one step ahead of training (the layout gives the engines ranks of their own)."""

    pending: StepOutputs | None = None  # the next step's batch, already gathered (checkpointed)

    def train_step(self, step: int) -> dict[str, float]:
        seed_everything(derive_seed(self.s.train.seed, "step", step, self.rank))
        started = time.perf_counter()
        more = step + 1 < self.total_steps
        out = self.pending
        if out is None:  # the first step (or a resume from a checkpoint without a batch in flight)
            with self.phase(Phase.GENERATE, step):
                out = self.rollouts.generate(step)
        self.phase.took()
        ahead, learned = None, None
        if self.roles.engine is not None:  # generate the next step with the weights before this step's update
            if more:
                with self.phase(Phase.GENERATE, step + 1):
                    ahead = self.rollouts.produce(step + 1, step, overlapped=True)
        else:
            learned = self.learn(step, out)
            if more:  # the engines are generating step+1 (and ahead): tell them
                self.rollouts.signal_trained()
        with self.phase(Phase.SYNC, step):
            self.sync_weights()
        times = {f"time/{name}": seconds for name, seconds in self.phase.took().items() if name != "generate"}
        waited = time.perf_counter()
        self.pending = None
        if more:
            with self.phase(Phase.GENERATE, step + 1):
                self.pending = self.rollouts.exchange(step + 1, ahead)
        times["time/wait_rollout"] = time.perf_counter() - waited
        self.step = step + 1
        if learned is None:  # engine ranks train nothing and log nothing (rank 0 is a learner)
            return {
                "step": step + 1,
                "reward": float(out.scores.float().mean()) if out.scores.numel() else float("nan"),
            }
        lag = {} if self.rollouts.partial else {"async/policy_lag": 1.0}  # else async/staleness_*
        return {**self.metrics(step, out, learned, times, time.perf_counter() - started), **lag}


@dataclass(frozen=True)
class PendingRollout:
    """The batch in flight as a checkpoint part: without it a resumed run would generate the next step with the
    restored weights, not the ones before the update that generated it. Rank 0 (`writer`) saves it; every rank
    loads it."""

    trainer: AsyncTrainer
    writer: bool

    def save(self, path: str) -> None:
        if self.writer and self.trainer.pending is not None:
            torch.save(self.trainer.pending.state(), os.path.join(path, PENDING_FILE))

    def load(self, path: str) -> None:
        pending = os.path.join(path, PENDING_FILE)
        if os.path.exists(pending):
            self.trainer.pending = StepOutputs.from_state(torch.load(pending, weights_only=True))
        else:
            get_logger(self.trainer.rank).info_once(
                f"{path} holds no rollout batch in flight (saved without --async_train): the step after it is "
                "generated with the restored weights"
            )
