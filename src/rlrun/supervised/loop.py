"""The training loop every supervised trainer shares: deterministic global batches over the dataset,
one optimizer step per batch (rlrun.roles.update.Updater: data-parallel shards, micro-batches, global loss
normalisation, clipping, non-finite gradients skipped), exact metrics summed over ranks, evaluation and
checkpoints at their steps."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Generic, Sequence, TypeVar

import torch

from rlrun.data.prompts import PromptSampler
from rlrun.reporting.metrics import MetricsSink
from rlrun.roles.forward import micro_batches
from rlrun.roles.update import Updater
from rlrun.runtime.faults import PhaseTracker
from rlrun.supervised.task import Task

S = TypeVar("S")


@dataclass
class Loop(Generic[S]):
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
    logging_steps: int
    phase: PhaseTracker
    steps_per_epoch: int = 1
    eval_before_train: bool = False
    step_done: int = 0  # steps finished (restored from a checkpoint)

    def step(self, step: int) -> dict[str, Any]:
        start = time.perf_counter()
        batch = [self.samples[i] for i in self.sampler.indices(step)]
        lengths = [self.task.loss_tokens(s) for s in batch]
        token_mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]

        def micro_loss(rows: torch.Tensor, num_tokens: float, num_seqs: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return self.task.micro_loss([batch[int(i)] for i in rows], num_tokens, num_seqs), {}

        stats = self.updater.run([torch.arange(len(batch))], token_mask.float(), micro_loss)
        sums = self._summed(self.task.tally.take())
        return {"step": step + 1, "epoch": self.sampler.episode_of(step), **self.task.summary(sums, evaluation=False),
                **stats, "time/step": time.perf_counter() - start}

    def evaluate(self) -> dict[str, float]:
        """Every rank scores its share of the evaluation set; the sums are exact over the whole set."""
        assert self.eval_samples is not None
        mine = list(self.eval_samples[self.rank::self.world_size])
        self.task.model.eval()
        with torch.no_grad():
            for rows in micro_batches(len(mine), self.micro_batch):
                self.task.score(mine[rows])
        summary = self.task.summary(self._summed(self.task.tally.take()), evaluation=True)
        return {f"eval/{k}": v for k, v in summary.items()}

    def _summed(self, local: dict[str, float]) -> dict[str, float]:
        keys = self.task.tally_keys  # the same on every rank, also one that scored nothing
        return dict(zip(keys, self.sum_over_ranks([local.get(k, 0.0) for k in keys])))

    def due_eval(self, steps_done: int) -> bool:
        """Every --eval_steps (-1: at the end of every epoch, as OpenRLHF), and after the last step (the reward
        model's saved mean/std come from it)."""
        every = self.eval_steps if self.eval_steps > 0 else self.steps_per_epoch
        return self.eval_samples is not None and (steps_done % every == 0 or steps_done == self.total_steps)

    def fit(self, sink: MetricsSink | None, after_step: Callable[[int], None]) -> list[dict[str, Any]]:
        history = []
        if self.eval_samples is not None and self.eval_before_train and self.step_done == 0:
            with self.phase("eval", -1):
                before = self.evaluate()
            if sink is not None:
                sink.log_eval(0, before)
        for step in range(self.step_done, self.total_steps):
            with self.phase("train", step):
                metrics = self.step(step)
            self.step_done = step + 1
            history.append(metrics)
            evals = None
            if self.due_eval(step + 1):
                with self.phase("eval", step):
                    evals = self.evaluate()
            if sink is not None and (step + 1) % self.logging_steps == 0:
                sink.log(metrics, evals)
            elif sink is not None and evals is not None:
                sink.log_eval(step + 1, evals)
            after_step(step + 1)
        return history
