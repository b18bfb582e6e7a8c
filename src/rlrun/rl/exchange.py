"""What crosses ranks in one RL step, so that rl/trainer.py reads as the algorithm.

Each role scores its shard of the batch at the same time as the others, and ONE all-gather of result slots
(rlrun.data.rollout) hands every learner every role's rows, put back in batch order (`Exchange.score` -> `Scored`).
The step's other exchanges are here too: --router_replay R2's recorded routing, the actor's on-policy log-probs
from its update (the scoring pass the on-policy branch skipped), the trained roles' whole-mini-batch losses and the
critic's stats for rank 0. Every call is collective over the learners: the world, or every rank but the engines
with --async_train. Tensors cross ranks only through rlrun.launch.transfer.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from rlrun.data.batching import TokenBudget, shard
from rlrun.data.rollout import RolloutBatch, SlotLayout, pack_slots, slot_layout, unpack_slots
from rlrun.launch.context import RankContext
from rlrun.launch.layout import Role
from rlrun.launch.transfer import all_gather_vectors, broadcast_json, gather_from, sum_over
from rlrun.models.moe import RoutingShape
from rlrun.rl.dynamic_batch import Budgets, scoring_order, unpermute
from rlrun.roles.update import LOSS_SHARES


@dataclass(frozen=True)
class Scored:
    """What scoring gives every learner about the batch: CPU tensors, identical on every learner, in batch order.
    Per token [B, R] unless noted; None where no role computes it."""

    scores: torch.Tensor  # [B]: the reward model's, else the rollouts' own (functions, agents)
    old_log_probs: torch.Tensor | None  # the actor's before the update (on-policy: the update's, after it)
    ref_log_probs: torch.Tensor | None
    teacher_log_probs: torch.Tensor | None  # --teacher_pretrain
    values: torch.Tensor | None  # the critic's
    routing: torch.Tensor | None = None  # [B, L, layers, k] uint8: --router_replay R2, recorded by the actor's pass


class Score(enum.Enum):
    """A per-row result a role computes in the scoring pass (the value: its field of `Scored`)."""

    OLD_LOG_PROBS = "old_log_probs"
    REF_LOG_PROBS = "ref_log_probs"
    TEACHER_LOG_PROBS = "teacher_log_probs"
    VALUES = "values"
    SCORES = "scores"


# rows, micro-batch (rows or a token budget) -> [rows, R] (or [rows] for scores)
Scorer = Callable[[RolloutBatch, "int | TokenBudget"], torch.Tensor]


@dataclass(frozen=True)
class ScoringJob:
    """One result of the scoring pass: which role's ranks compute it, and this rank's scorer (None where this rank
    does not hold the role)."""

    result: Score
    role: Role
    scorer: Scorer | None


class Exchange:
    """The step's exchanges between ranks (module docstring). `micro_rows`: --micro_rollout_batch_size, the scoring
    micro-batch where no token budget applies."""

    def __init__(self, ctx: RankContext, budgets: Budgets, micro_rows: int) -> None:
        groups = ctx.groups
        self.groups, self.layout, self.rank = groups, ctx.layout, groups.rank
        self.budgets, self.micro_rows = budgets, micro_rows
        # NCCL needs device tensors; gloo takes them too (staged through host memory by its CUDA collectives: ran on
        # an H200 with --dist_backend gloo --device cuda), so the exchange never moves them by hand.
        self.device = ctx.device
        asynchronous = self.layout.asynchronous
        self.learners = groups.get("learners") if asynchronous else groups.world
        engines = set(self.layout.ranks_of(Role.ENGINE)) if asynchronous else set()
        self.learner_ranks = [r for r in range(self.layout.world_size) if r not in engines]

    def score(self, batch: RolloutBatch, jobs: list[ScoringJob], rewards: torch.Tensor) -> Scored:
        """Every job's rows on every learner: each role's ranks score their shard (with --dynamic_batch the rows dealt
        by length, so that a role's ranks score about the same tokens), one all-gather returns all. `rewards`: the
        rollouts' own scores, where no reward model scores them."""
        B, R = batch.sequences.shape[0], batch.response_width
        widths, ranks, mine, orders = {}, {}, {}, {}
        for job in jobs:
            if not self.layout.has(job.role):
                continue
            key = job.result.value
            # The ranks that report a result's rows: the role's, or with sequence parallelism the first of each group
            # (its other ranks score the same rows with it).
            widths[key] = 1 if job.result is Score.SCORES else R
            ranks[key] = self.layout.reporting_ranks(job.role)
            orders[key] = scoring_order(batch, len(ranks[key]), self.budgets.on)
            if job.scorer is not None:
                dp_rank, dp_size = self.layout.data_parallel(job.role, self.rank)
                rows = batch.rows(orders[key][shard(B, dp_size, dp_rank)])
                scored = job.scorer(rows, self.budgets.score_micro(job.role, self.micro_rows))
                if self.rank in ranks[key]:
                    mine[key] = scored
        plan = slot_layout(B, widths, ranks)
        gathered = self._gather_slots(plan, pack_slots(plan, self.rank, mine))
        results = {key: unpermute(values, orders[key]) for key, values in gathered.items()}
        return Scored(
            scores=results.get(Score.SCORES.value, rewards),
            old_log_probs=results.get(Score.OLD_LOG_PROBS.value),
            ref_log_probs=results.get(Score.REF_LOG_PROBS.value),
            teacher_log_probs=results.get(Score.TEACHER_LOG_PROBS.value),
            values=results.get(Score.VALUES.value),
        )

    def _gather_slots(self, plan: SlotLayout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every learner's packed results -> {result: all rows} on CPU."""
        assert self.learners is not None  # a learner's
        return unpack_slots(plan, all_gather_vectors(flat.to(self.device), self.learners).cpu(), self.learner_ranks)

    def recorded_routing(self, batch: RolloutBatch, shape: RoutingShape, mine: torch.Tensor | None) -> torch.Tensor:
        """--router_replay R2: [B, L, layers, k] uint8 on every learner, the experts each token went through in the
        actor's scoring pass (`mine`: this rank's shard, None off the actor's reporting ranks), in batch order. One
        gather, as large as R3's routing from the engines."""
        assert self.learners is not None  # a learner's
        B, L = batch.sequences.shape
        ranks = self.layout.reporting_ranks(Role.ACTOR)
        share = (B // len(ranks), L, shape.layers, shape.top_k)
        gathered = gather_from(
            ranks, mine if self.rank in ranks else None, share, torch.uint8, self.learners, self.device
        )
        return unpermute(gathered.cpu(), scoring_order(batch, len(ranks), self.budgets.on))

    def on_policy_log_probs(self, batch: RolloutBatch, mine: torch.Tensor | None) -> torch.Tensor:
        """[B, R] on every learner: the actor's log-probs from its on-policy update (before it changed the weights),
        standing in for the scoring pass the on-policy branch skipped. `mine`: [b, 1 + R] this rank's rows (global
        index, then log-probs), None off the actor. One all-gather."""
        B, R = batch.sequences.shape[0], batch.response_width
        ranks = self.layout.reporting_ranks(Role.ACTOR)  # a sequence-parallel group trained the same rows
        key = Score.OLD_LOG_PROBS.value
        plan = slot_layout(B, {key: R + 1}, {key: ranks})
        shards = {key: mine} if self.rank in ranks and mine is not None else {}
        rows_and_logp = self._gather_slots(plan, pack_slots(plan, self.rank, shards))[key]
        out = torch.zeros(B, R)
        out[rows_and_logp[:, 0].long()] = rows_and_logp[:, 1:]
        return out

    def whole_losses(self, role: Role, stats: dict[str, float]) -> dict[str, float]:
        """A trained role's logged losses as the whole mini-batch's, whatever the layout: each rank's value is its
        tokens' part of the loss scaled by the data-parallel size (the normalisation its gradient needs), so their mean
        over the role's ranks is the mini-batch's loss (OpenRLHF logs the ranks' mean too). Collective over the role's
        group; a sequence-parallel group's ranks hold the same value."""
        keys = sorted(k for k in stats if k in LOSS_SHARES)
        group, ranks = self.groups.role(role), len(self.layout.ranks_of(role))
        if not keys or group is None or ranks == 1:
            return stats
        totals = sum_over([stats[k] for k in keys], group, self.device)
        return stats | {k: total / ranks for k, total in zip(keys, totals)}

    def critic_stats_on_rank0(self, stats: dict[str, float]) -> dict[str, float]:
        """The critic's stats live on its first rank; rank 0 logs them (collective over the learners)."""
        if not self.layout.has(Role.CRITIC) or (src := self.layout.ranks_of(Role.CRITIC)[0]) == 0:
            return {}
        mine = {k: v for k, v in stats.items() if k.startswith("critic/")} if self.rank == src else None
        assert self.learners is not None  # a learner's
        return cast("dict[str, float]", broadcast_json(mine, src, self.learners, self.device))
