"""What a layout is: which ranks play which RLHF role, which engines they form, and which process groups to
create. The request (`LayoutRequest`, one `RoleRequest` per model role) and the result (`Layout`);
:func:`rlrun.plan.placement.plan_layout` turns one into the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING

from rlrun.runtime.errors import LayoutError


class Role(str, Enum):
    ACTOR = "actor"
    CRITIC = "critic"
    REF = "ref"
    TEACHER = "teacher"
    REWARD = "reward"
    ENGINE = "engine"


@dataclass(frozen=True)
class RoleRequest:
    """OpenRLHF's ``--X_num_nodes`` / ``--X_num_gpus_per_node``; ``gpus_per_node=None`` = unsized.
    ``node_label``: rlrun's ``--X_node_label``, the node label this role's ranks must carry (None: any node)."""

    num_nodes: int | None = None
    gpus_per_node: int | None = None
    node_label: str | None = None

    @property
    def size(self) -> int | None:
        return None if self.gpus_per_node is None else (self.num_nodes or 1) * self.gpus_per_node


@dataclass(frozen=True)
class LayoutRequest:
    actor: RoleRequest = RoleRequest()
    critic: RoleRequest = RoleRequest()
    ref: RoleRequest = RoleRequest()
    reward: RoleRequest = RoleRequest()
    teacher: RoleRequest = RoleRequest()
    need_critic: bool = True
    need_ref: bool = True
    need_reward: bool = True
    need_teacher: bool = False  # on-policy distillation (--teacher_pretrain)
    vllm_num_engines: int | None = None
    vllm_tensor_parallel_size: int = 1
    colocate_actor_ref: bool = False
    colocate_actor_teacher: bool = False
    colocate_critic_reward: bool = False
    colocate_all_models: bool = False
    engine_node_label: str | None = None
    async_train: bool = False  # engines generate the next batch while the other ranks train: adds "learners"
    partial_rollout: bool = False  # with async_train: the engines generate ahead until told: adds "ready"
    # Disjoint engines take the weights on their first rank only (a vLLM child's tensor-parallel workers read them
    # from there): "sync" is the actor's first rank and each engine's first rank.
    sync_engine_leaders: bool = False
    # Disjoint engines: "sync.senders" holds every actor rank and the engines' receiving ranks, so that each actor
    # rank sends its own shard (rlrun.weight_sync.senders; used for an actor on several ranks, or a delta sync)
    many_senders: bool = False
    ref_is_actor_base: bool = False  # LoRA: the actor scores the reference log-probs with its adapters off
    # Ulysses sequence parallelism: each model role's ranks split into groups of this many consecutive ranks that
    # share a micro-batch's tokens (absent: 1)
    sequence_parallel: tuple[tuple[Role, int], ...] = ()


@dataclass(frozen=True)
class GroupSpec:
    name: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    world_size: int
    ranks_per_node: int
    roles: Mapping[Role, tuple[int, ...]] = field(hash=False)
    engines: tuple[tuple[int, ...], ...]
    groups: tuple[GroupSpec, ...]
    warnings: tuple[str, ...] = ()
    node_labels: tuple[str, ...] | None = None  # one per node, when the placement knew them
    sequence_parallel: Mapping[Role, int] = field(default_factory=dict, hash=False)  # > 1 only

    def __post_init__(self) -> None:
        # Read-only, so no module can change a layout the other ranks still hold.
        object.__setattr__(self, "roles", MappingProxyType(dict(self.roles)))
        object.__setattr__(self, "sequence_parallel", MappingProxyType(dict(self.sequence_parallel)))
        actor, engine = set(self.ranks_of(Role.ACTOR)), set(self.ranks_of(Role.ENGINE))
        # Weight sync has two implementations (in place; broadcast to disjoint ranks); a partial overlap has none.
        if engine != actor and engine & actor:
            raise LayoutError(
                f"engine ranks {sorted(engine)} partly overlap actor ranks {sorted(actor)} (world size "
                f"{self.world_size}, {self.ranks_per_node} ranks per node); the engine must use exactly the "
                "actor's ranks or ranks disjoint from them"
            )

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(
                f"rank {rank} is outside world size {self.world_size}; valid ranks are 0..{self.world_size - 1}"
            )

    def roles_of(self, rank: int) -> tuple[Role, ...]:
        self._check_rank(rank)
        return tuple(role for role in Role if rank in self.ranks_of(role))

    def ranks_of(self, role: Role) -> tuple[int, ...]:
        return self.roles.get(role, ())

    def has(self, role: Role) -> bool:
        return bool(self.ranks_of(role))

    def group_names_of(self, rank: int) -> tuple[str, ...]:
        self._check_rank(rank)
        return tuple(group.name for group in self.groups if rank in group.ranks)

    def engine_index_of(self, rank: int) -> int | None:
        self._check_rank(rank)
        return next((i for i, ranks in enumerate(self.engines) if rank in ranks), None)

    def sp_of(self, role: Role) -> int:
        """The role's sequence-parallel size (1: none)."""
        return self.sequence_parallel.get(role, 1)

    def data_parallel(self, role: Role, rank: int) -> tuple[int, int]:
        """(this rank's data-parallel index, the data-parallel size) within the role: the role's ranks in groups of
        sp consecutive ranks, each group one data-parallel share."""
        ranks, sp = self.ranks_of(role), self.sp_of(role)
        return ranks.index(rank) // sp, len(ranks) // sp

    def sp_group_name(self, role: Role, rank: int) -> str | None:
        """The name of the sequence-parallel group `rank` shares with its role's other ranks (None: no SP)."""
        sp = self.sp_of(role)
        if sp == 1:
            return None
        ranks = self.ranks_of(role)
        start = ranks.index(rank) // sp * sp
        return sp_group_name(ranks[start : start + sp])

    def reporting_ranks(self, role: Role) -> tuple[int, ...]:
        """The role's ranks that report its per-row results: the first of each sequence-parallel group (all of
        them without SP); the group's other ranks computed the same rows."""
        return self.ranks_of(role)[:: self.sp_of(role)]

    @property
    def asynchronous(self) -> bool:
        """--async_train in effect: the engines have ranks of their own and a "learners" group exists."""
        return any(g.name == "learners" for g in self.groups)

    @property
    def engine_colocated_with_actor(self) -> bool:
        return self.ranks_of(Role.ENGINE) == self.ranks_of(Role.ACTOR)


def colocated_layout(world_size: int, ranks_per_node: int) -> Layout:
    """Every rank an actor rank with an in-process engine of its own beside it (rlrun.tinker's native or HF engines,
    which need no group): the actor's group is the world."""
    ranks = tuple(range(world_size))
    engines = tuple((r,) for r in ranks)
    groups = (GroupSpec("world", ranks), GroupSpec(Role.ACTOR.value, ranks))
    return Layout(world_size, ranks_per_node, {Role.ACTOR: ranks, Role.ENGINE: ranks}, engines, groups)


def sp_group_name(ranks: Sequence[int]) -> str:
    return f"sp.{ranks[0]}-{ranks[-1]}"


# ---- printing ----------------------------------------------------------------------------------------------------
# How a :class:`~rlrun.launch.layout.Layout` is described for humans: the per-rank table logged by ``--dry_run``
# and after the node-label placement at start-up, and the short run-length summary of node labels that placement errors
# quote. Pure string formatting; the planning itself is in rlrun.plan.placement.

if TYPE_CHECKING:
    from rlrun.launch.env import DistEnv


def layout_heading(env: DistEnv) -> str:
    """'layout: 8 ranks (8 per node, launcher torchrun)': the line above the table, at start-up and in --dry_run."""
    return (
        f"layout: {env.world_size} rank{'s' if env.world_size > 1 else ''} ({env.local_world_size} per node, "
        f"launcher {env.launcher})"
    )


def describe_nodes(node_labels: Sequence[str]) -> str:
    """'nodes 0-1 'a', node 2 'b'': runs of equally labelled nodes, so 64 nodes stay one short line."""
    runs: list[tuple[int, int, str]] = []
    for node, label in enumerate(node_labels):
        if runs and runs[-1][2] == label and runs[-1][1] == node - 1:
            runs[-1] = (runs[-1][0], node, label)
        else:
            runs.append((node, node, label))
    return ", ".join(f"node {a} {label!r}" if a == b else f"nodes {a}-{b} {label!r}" for a, b, label in runs)


def format_layout_table(layout: Layout) -> str:
    """One row per rank (rank | node | local | roles | groups; with known node labels rank | node | label |
    local | roles | groups), then the warnings."""
    rpn, labels = layout.ranks_per_node, layout.node_labels
    rows: list[tuple[str, ...]] = [("rank", "node", *(("label",) if labels else ()), "local", "roles", "groups")]
    for rank in range(layout.world_size):
        roles = ",".join(role.value for role in layout.roles_of(rank))
        label = (labels[rank // rpn],) if labels else ()
        rows.append(
            (str(rank), str(rank // rpn), *label, str(rank % rpn), roles, ",".join(layout.group_names_of(rank)))
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(lines + [f"warning: {warning}" for warning in layout.warnings])
