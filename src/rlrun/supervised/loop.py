"""The loop every supervised trainer (rlrun.sft, rlrun.rm, rlrun.dpo) runs: deterministic global batches over the
dataset, one optimizer step each (rlrun.roles.update.Updater: data-parallel shards, micro-batches, global loss
normalisation, clipping, non-finite gradients skipped), metrics summed exactly over the ranks, and evaluation when
due. The run skeleton (rlrun.run.skeleton) drives it step by step; it is a torch Stateful the checkpointer saves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from rlrun.data.prompts import PromptSampler
from rlrun.roles.forward import micro_batches
from rlrun.roles.update import Updater
from rlrun.runtime.phases import Phase, PhaseTracker
from rlrun.supervised.tasks import Task

S = TypeVar("S")


@dataclass
class Loop(Generic[S]):
    """One supervised trainer's steps on this rank; a torch Stateful (the step and the update loop's schedule)."""

    task: Task[S]
    updater: Updater
    samples: Sequence[S]
    eval_samples: Sequence[S] | None
    sampler: PromptSampler  # step -> sample indices (the record order of each epoch depends on the seed only)
    total_steps: int
    # element-wise sum over every rank (rlrun.launch.transfer.sum_over bound to the all-ranks group)
    sum_over_ranks: Callable[[list[float]], list[float]]
    rank: int
    world_size: int
    micro_batch: int
    eval_steps: int
    phase: PhaseTracker
    steps_per_epoch: int = 1
    eval_before_train: bool = False
    # ranks per sequence-parallel block: each of them tallies its block's samples, so the sums over ranks count
    # every sample that many times
    sequence_parallel: int = 1
    step: int = 0  # steps done (restored from a checkpoint)

    def train_step(self, step: int) -> dict[str, Any]:
        with self.phase(Phase.TRAIN, step):
            start = time.perf_counter()
            batch = [self.samples[i] for i in self.sampler.indices(step)]
            lengths = [self.task.loss_tokens(s) for s in batch]
            token_mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]

            def micro_loss(
                rows: torch.Tensor, num_tokens: float, num_seqs: float
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
                return self.task.micro_loss([batch[int(i)] for i in rows], num_tokens, num_seqs), {}

            stats = self.updater.run([torch.arange(len(batch))], token_mask.float(), micro_loss)
            sums = self._summed(self.task.tally.take())
            metrics = {
                "step": step + 1,
                "epoch": self.sampler.episode_of(step),
                **self.task.summary(sums, evaluation=False),
                **stats,
                "time/step": time.perf_counter() - start,
            }
        self.step = step + 1
        return metrics

    def evaluate(self, steps_done: int) -> dict[str, float] | None:
        """Every rank scores its share of the evaluation set; the sums are exact over the whole set. Due every
        --eval_steps (-1: at the end of every epoch, as OpenRLHF), after the last step (the reward model's saved
        mean/std come from it), and with --eval_before_train before the first."""
        if self.eval_samples is None:
            return None
        every = self.eval_steps if self.eval_steps > 0 else self.steps_per_epoch
        due = self.eval_before_train if steps_done == 0 else steps_done % every == 0 or steps_done == self.total_steps
        if not due:
            return None
        with self.phase(Phase.EVAL, steps_done - 1):
            # a sequence-parallel block scores one share, a token shard per rank
            dp_rank, dp_size = self.rank // self.sequence_parallel, self.world_size // self.sequence_parallel
            mine = list(self.eval_samples[dp_rank::dp_size])
            self.task.model.eval()
            with torch.no_grad():
                for rows in micro_batches(len(mine), self.micro_batch):
                    self.task.score(mine[rows])
            summary = self.task.summary(self._summed(self.task.tally.take()), evaluation=True)
        return {f"eval/{k}": v for k, v in summary.items()}

    def _summed(self, local: dict[str, float]) -> dict[str, float]:
        keys = self.task.tally_keys  # the same on every rank, also one that scored nothing
        summed = self.sum_over_ranks([local.get(k, 0.0) for k in keys])
        return {key: value / self.sequence_parallel for key, value in zip(keys, summed)}

    def begin(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "updater": self.updater.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.updater.load_state_dict(state["updater"])
        self.step = int(state["step"])
