"""How a :class:`~rlrun.launch.layout.Layout` is described for humans: the per-rank table logged by ``--dry_run``
and after the node-label placement at start-up, and the short run-length summary of node labels that placement errors
quote. Pure string formatting; the planning itself is in rlrun.launch.layout_plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlrun.launch.env import DistEnv
    from rlrun.launch.layout import Layout


def layout_heading(env: DistEnv) -> str:
    """'layout: 8 ranks (8 per node, launcher torchrun)': the line above the table, at start-up and in --dry_run."""
    return (f"layout: {env.world_size} rank{'s' if env.world_size > 1 else ''} ({env.local_world_size} per node, "
            f"launcher {env.launcher})")


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
        rows.append((str(rank), str(rank // rpn), *label, str(rank % rpn), roles, ",".join(layout.group_names_of(rank))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return "\n".join(lines + [f"warning: {warning}" for warning in layout.warnings])
