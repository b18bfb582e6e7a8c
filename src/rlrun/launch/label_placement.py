"""Node-label placement: which ranks each block of colocated roles gets when roles ask for node labels.

Node labels (``RoleRequest.node_label``, ``engine_node_label``; ``node_labels`` = one label per node): a block whose
roles ask for a label goes on ranks of nodes carrying it: labelled blocks first (block order), each on the lowest free
ranks of its nodes, then the other blocks on the lowest ranks left. Colocated roles asking different labels, or a
label whose nodes lack the ranks, are errors naming every node's label. When the consecutive placement already honours
the labels (or none is asked, or ``node_labels=None`` before start-up) it is kept.

Pure functions called by :func:`rlrun.launch.layout_plan.plan_layout`, which builds the blocks; a block is
``(roles sharing the same consecutive ranks, how many ranks)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rlrun.launch.layout_text import describe_nodes
from rlrun.runtime.errors import LayoutError

if TYPE_CHECKING:
    from rlrun.launch.layout import Role

    _Block = tuple[tuple[Role, ...], int]


def block_labels(blocks: Sequence[_Block], asked: Mapping[Role, str], ctx: str) -> list[str | None]:
    """The one node label each block asks for (None: any node); colocated roles must agree.
    ``asked``: every role that asks for a node label, with its label."""
    out: list[str | None] = []
    for roles, _ in blocks:
        wants = {role: asked[role] for role in roles if role in asked}
        if len(set(wants.values())) > 1:
            wanted = ", ".join(f"--{role.value}_node_label {label!r}" for role, label in wants.items())
            raise LayoutError(
                f"{'/'.join(role.value for role in roles)} share the same ranks, but ask for different node labels "
                f"({wanted}); give them the same label or label only one{ctx}"
            )
        out.append(next(iter(wants.values()), None))
    return out


def place_blocks(
    blocks: Sequence[_Block], labels: Sequence[str | None], world_size: int, rpn: int,
    node_labels: Sequence[str] | None, ctx: str,
) -> dict[Role, tuple[int, ...]]:
    """Ranks for each block: consecutive from rank 0 in block order when that already honours every asked label
    (or none is asked, or the labels are unknown). Otherwise the labelled blocks first, each on the lowest free
    ranks of nodes carrying its label, then the others on the lowest free ranks left."""
    placed: dict[Role, tuple[int, ...]] = {}
    start = 0
    for (block_roles, size), label in zip(blocks, labels):
        ranks = tuple(range(start, start + size))
        if node_labels is not None and label is not None and any(node_labels[r // rpn] != label for r in ranks):
            break
        placed.update((role, ranks) for role in block_roles)
        start += size
    else:
        return placed
    placed = {}
    free = list(range(world_size))
    order = [i for i, label in enumerate(labels) if label is not None] + [i for i, label in enumerate(labels) if label is None]
    for i in order:
        (block_roles, size), label = blocks[i], labels[i]
        pool = [rank for rank in free if label is None or node_labels[rank // rpn] == label]
        if len(pool) < size:
            names = "/".join(role.value for role in block_roles)
            carrying = sum(1 for node_label in node_labels if node_label == label)
            have = (f"{carrying} node(s) carry that label ({carrying * rpn} ranks, {len(pool)} of them left after "
                    "the other labelled blocks)") if carrying else "no node carries that label"
            raise LayoutError(
                f"the {names} block of {size} rank{'s' if size != 1 else ''} asks for nodes labelled {label!r}, but "
                f"{have}; node labels: {describe_nodes(node_labels)}; label more nodes {label!r} "
                f"(RLRUN_NODE_LABEL, default the host name) or shrink the blocks that ask for it{ctx}"
            )
        take = pool[:size]
        placed.update((role, tuple(take)) for role in block_roles)
        taken = set(take)
        free = [rank for rank in free if rank not in taken]
    return placed
