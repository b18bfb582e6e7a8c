"""Create every process group of a layout: the one place `new_group` is called."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from rlrun.launch.layout import Layout, Role


@dataclass(frozen=True)
class SequenceParallel:
    """A rank's sequence-parallel group: `size` consecutive ranks, this rank the `rank`-th of them."""

    group: dist.ProcessGroup
    size: int
    rank: int


@dataclass
class Groups:
    """The groups this rank belongs to, by layout name ("world", "actor", "engine.0", "sync", ...)."""

    rank: int
    layout: Layout
    member: dict[str, dist.ProcessGroup] = field(default_factory=dict)

    def get(self, name: str) -> dist.ProcessGroup | None:
        return self.member.get(name)

    def role(self, role: Role) -> dist.ProcessGroup | None:
        return self.member.get(role.value)

    def sequence_parallel(self, role: Role) -> SequenceParallel | None:
        """This rank's sequence-parallel group of `role` (None: the role has none, or this rank does not play it)."""
        if role not in self.layout.roles_of(self.rank):
            return None
        name = self.layout.sp_group_name(role, self.rank)
        if name is None:
            return None
        ranks = next(spec.ranks for spec in self.layout.groups if spec.name == name)
        return SequenceParallel(self.member[name], len(ranks), ranks.index(self.rank))

    @property
    def world(self) -> dist.ProcessGroup:
        return self.member["world"]

    @property
    def solo(self) -> dist.ProcessGroup | None:
        """This rank alone (DeepSpeed's model-parallel group), when the run asked for it."""
        return self.member.get("solo")


def build_groups(layout: Layout, timeout_s: float, sync_backend: str | None = None, *, solo: bool = False) -> Groups:
    """Every rank calls new_group for every group, in the layout's fixed order, even groups it is
    not in: new_group is collective over the world and a skipped call deadlocks the others.
    `solo` (DeepSpeed runs): then every rank's one-rank group (`solo_group`)."""
    rank = dist.get_rank()
    timeout = timedelta(seconds=timeout_s)
    groups = Groups(rank=rank, layout=layout)
    for spec in layout.groups:
        backend = sync_backend if spec.name in ("sync", "sync.senders") else "gloo" if spec.name == "ready" else None
        group = dist.new_group(list(spec.ranks), timeout=timeout, backend=backend, group_desc=spec.name)
        if rank in spec.ranks:
            groups.member[spec.name] = group
    if solo:
        groups.member["solo"] = solo_group(timeout_s)
    return groups


def solo_group(timeout_s: float) -> dist.ProcessGroup:
    """This rank alone, for DeepSpeed's model-parallel group (a real one-rank group: None would send its
    gradient-norm all_reduce to the world). Every rank makes every rank's one-rank group, in rank order, like every
    other group here: a group made by some ranks only hangs a world whose groups are created eagerly (NCCL with a
    bound device splits its communicator over the whole world at each new_group, pytorch issue 145376)."""
    rank, timeout = dist.get_rank(), timedelta(seconds=timeout_s)
    mine = None
    for r in range(dist.get_world_size()):
        group = dist.new_group([r], timeout=timeout, group_desc=f"solo{r}")
        if r == rank:
            mine = group
    assert mine is not None
    return mine


def sequence_parallel_groups(size: int, timeout_s: float) -> SequenceParallel | None:
    """The supervised trainers' sequence-parallel groups: blocks of `size` consecutive ranks, every block made by
    every rank in rank order (as `solo_group`); this rank's block, or None for size 1."""
    if size == 1:
        return None
    rank, world, timeout = dist.get_rank(), dist.get_world_size(), timedelta(seconds=timeout_s)
    mine = None
    for first in range(0, world, size):
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks, timeout=timeout, group_desc=f"sp.{first}-{first + size - 1}")
        if rank in ranks:
            mine = SequenceParallel(group, size, rank - first)
    assert mine is not None, (rank, world, size)  # check_supervised: the world divides by size
    return mine


def all_ranks_group(timeout_s: float) -> dist.ProcessGroup:
    """One group of every rank (the supervised trainers' data-parallel group): collective over the world."""
    return dist.new_group(
        list(range(dist.get_world_size())), timeout=timedelta(seconds=timeout_s), group_desc="data_parallel"
    )
