"""--dynamic_batch in the RL loop: each role's token budgets (training and scoring), bound to the role's group for
the one all-reduce that makes every rank of the role run the same number of micro-batches, and the length-balanced
order in which the scoring pass deals rows to a role's ranks (rlrun.data.batching has the arithmetic)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from rlrun.config.training import TrainConfig
from rlrun.data.batching import RowLengths, TokenBudget, balanced_order
from rlrun.data.rollout import RolloutBatch
from rlrun.launch.groups import Groups
from rlrun.launch.layout import Role
from rlrun.launch.transfer import max_over

_ROLES = (Role.ACTOR, Role.CRITIC, Role.REF, Role.TEACHER, Role.REWARD)


@dataclass(frozen=True)
class Budgets:
    """The token budgets of the roles this rank plays (empty without --dynamic_batch)."""

    train: dict[Role, TokenBudget] = field(default_factory=dict)
    score: dict[Role, TokenBudget] = field(default_factory=dict)

    @property
    def on(self) -> bool:
        return bool(self.train)

    def score_micro(self, role: Role, rows: int) -> int | TokenBudget:
        """What a role's scoring forward is split by: its budget, or `rows` per micro-batch."""
        return self.score.get(role, rows)


def role_budgets(t: TrainConfig, groups: Groups, device: torch.device) -> Budgets:
    """--train_max_tokens_per_gpu for the updates and --rollout_max_tokens_per_gpu (unset: the same) for scoring,
    for every role whose group this rank is in; the count agreement is an all-reduce over that group."""
    if not t.dynamic_batch:
        return Budgets()
    scoring = t.rollout_max_tokens_per_gpu if t.rollout_max_tokens_per_gpu is not None else t.train_max_tokens_per_gpu
    train, score = {}, {}
    for role in _ROLES:
        group = groups.role(role)
        if group is None:
            continue
        agree = functools.partial(max_over, group=group, device=device)
        # a sequence-parallel group's micro-batch holds sp x the per-rank budget (each rank runs 1/sp of it; verl)
        sp = groups.layout.sp_of(role)
        train[role] = TokenBudget(t.train_max_tokens_per_gpu * sp, t.packing_samples, agree)
        score[role] = TokenBudget(scoring * sp, t.packing_samples, agree)
    return Budgets(train, score)


def scoring_order(batch: RolloutBatch, num_ranks: int, dynamic: bool) -> torch.Tensor:
    """[B] the row order whose contiguous equal shards the scoring pass hands to a role's `num_ranks` ranks: the
    rows as they are, or (--dynamic_batch) dealt by length so that every rank scores about the same tokens.
    Identical on every rank (a function of the batch every rank holds)."""
    if not dynamic:
        return torch.arange(batch.sequences.shape[0])
    return balanced_order(RowLengths.of(batch), num_ranks)


def unpermute(values: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """[B, ...] values in `order` -> [B, ...] with row order[j] at index order[j]."""
    out = torch.empty_like(values)
    out[order] = values
    return out
