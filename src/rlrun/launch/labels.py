"""Every node's label (RLRUN_NODE_LABEL, else the host name), gathered once at start-up for --X_node_label."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlrun.launch.env import MAX_NODE_LABEL_BYTES
from rlrun.launch.transfer import all_gather_vectors
from rlrun.runtime.errors import LayoutError

_WIDTH = MAX_NODE_LABEL_BYTES + 1  # one length byte, then the UTF-8 bytes


def encode_label(label: str) -> torch.Tensor:
    """label -> [_WIDTH] uint8: length, bytes, zero padding."""
    data = label.encode()
    if len(data) > MAX_NODE_LABEL_BYTES:
        raise LayoutError(f"node label {label[:40]!r}... is longer than {MAX_NODE_LABEL_BYTES} bytes")
    out = torch.zeros(_WIDTH, dtype=torch.uint8)
    out[0] = len(data)
    if data:
        out[1:1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def decode_label(row: torch.Tensor) -> str:
    """[_WIDTH] uint8 -> label."""
    values = row.tolist()
    return bytes(values[1:1 + values[0]]).decode()


def labels_per_node(rank_labels: list[str], ranks_per_node: int) -> tuple[str, ...]:
    """One label per node from one per rank (node n = ranks n*ranks_per_node ...); every rank of a node must
    report the same label. Pure, so every rank reaches the same answer or the same error."""
    nodes = []
    for node in range(len(rank_labels) // ranks_per_node):
        seen = rank_labels[node * ranks_per_node:(node + 1) * ranks_per_node]
        if len(set(seen)) != 1:
            raise LayoutError(
                f"the ranks of node {node} (ranks {node * ranks_per_node}-{(node + 1) * ranks_per_node - 1}) report "
                f"different node labels {seen}; set RLRUN_NODE_LABEL once per node, for all its processes")
        nodes.append(seen[0])
    return tuple(nodes)


def gather_node_labels(label: str, ranks_per_node: int, device: torch.device) -> tuple[str, ...]:
    """All-gather every rank's label on the default group (the role groups do not exist yet); collective."""
    rows = all_gather_vectors(encode_label(label).to(device), dist.group.WORLD).cpu()
    return labels_per_node([decode_label(row) for row in rows], ranks_per_node)
