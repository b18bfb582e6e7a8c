"""Moving tensors between roles: the rollout and result exchanges, and the bounded waits every collective here shares.

Tokens are small, so rollouts move simply (padded tensors + lengths, one gather). Weights move in
rlrun.weight_sync.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from rlrun.launch.dist import collective_device
from rlrun.launch.env import MAX_NODE_LABEL_BYTES
from rlrun.runtime.errors import LayoutError, RlrunError

# torch >= 2.10 renamed all_gather_into_tensor (which now warns on every call).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def gather_from(
    ranks: Sequence[int],
    local: torch.Tensor | None,
    shape: Sequence[int],
    dtype: torch.dtype,
    group: dist.ProcessGroup,
    device: torch.device,
) -> torch.Tensor:
    """Concatenate (dim 0) one [*shape] tensor from each rank in `ranks`, in that order; every
    rank of `group` receives the result. Ranks outside `ranks` pass local=None."""
    group_ranks = dist.get_process_group_ranks(group)
    if list(ranks) == list(group_ranks):
        assert local is not None
        out = torch.empty((len(ranks) * shape[0], *shape[1:]), dtype=dtype, device=device)
        _all_gather_single(out, local.to(device).contiguous(), group=group)
        return out
    parts = []
    me = dist.get_rank()
    for src in ranks:
        buf = (
            local.to(device).contiguous()
            if src == me and local is not None
            else torch.empty(tuple(shape), dtype=dtype, device=device)
        )
        dist.broadcast(buf, src=src, group=group)
        parts.append(buf)
    return torch.cat(parts, dim=0)


def all_gather_vectors(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[S] from every rank of `group` -> [world, S] on every rank."""
    world = dist.get_world_size(group)
    out = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    _all_gather_single(out, local.contiguous(), group=group)
    return out.view(world, local.numel())


def sum_over(values: Sequence[float], group: dist.ProcessGroup, device: torch.device) -> list[float]:
    """Element-wise sum of `values` over the ranks of `group` (float64, so counts stay exact)."""
    buf = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(buf, group=group)
    return buf.cpu().tolist()


def max_over(value: int, group: dist.ProcessGroup, device: torch.device) -> int:
    """The largest `value` over the ranks of `group`, on every one of them (e.g. the micro-batch count all ranks of
    a role must run: --dynamic_batch). `device`: this rank's compute device (NCCL groups need it)."""
    buf = torch.tensor([int(value)], dtype=torch.int64, device=collective_device(dist.get_backend(group), device))
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    return int(buf.item())


def broadcast_json(obj: object, src: int, group: dist.ProcessGroup, device: torch.device) -> object:
    """Small metadata as JSON bytes (never pickle: nothing is unpickled from another host)."""
    if dist.get_rank() == src:
        payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.empty(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if dist.get_rank() != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=src, group=group)
    return json.loads(bytes(payload.cpu().tolist()).decode())


def gather_json(obj: object, group: dist.ProcessGroup, device: torch.device) -> list[Any] | None:
    """Every rank's small JSON-able `obj`, in group-rank order, on the group's first rank (None on the others): two
    all-gathers (the sizes, then the padded bytes). JSON, never pickle, as broadcast_json."""
    payload = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
    sizes = all_gather_vectors(torch.tensor([payload.numel()], dtype=torch.int64, device=device), group)[:, 0]
    width = int(sizes.max())
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    rows = all_gather_vectors(padded, group).cpu()
    if dist.get_rank(group) != 0:
        return None
    return [json.loads(bytes(row[: int(n)].tolist()).decode()) for row, n in zip(rows, sizes.tolist())]


def gather_vision(
    ranks: Sequence[int], local: dict[str, torch.Tensor] | None, group: dist.ProcessGroup, device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """The rows' images of each rank in `ranks` (rlrun.data.vision_batch.RowVision.state(): pixels [patches, dim], grids
    [images, 3], images per prompt [prompts], row_entry [rows]), in that order, on every rank of `group`. Two
    collectives per rank: the small index tensors as JSON (with the pixels' shape), then the pixels, whose size varies
    by rank (one entry per prompt, so a prompt's pixels cross once however many samples it has). Ranks outside
    `ranks` pass local=None."""
    me, out = dist.get_rank(), []
    for src in ranks:
        state = local if src == me else None
        small = (
            None
            if state is None
            else {
                "pixels": list(state["pixels"].shape),
                **{k: state[k].tolist() for k in ("grids", "images", "row_entry")},
            }
        )
        meta: dict = broadcast_json(small, src, group, device)  # type: ignore[assignment]
        shape = meta["pixels"]
        mine = None if state is None else state["pixels"].float()
        pixels = gather_from([src], mine, shape, torch.float32, group, device).cpu() if shape[0] else torch.zeros(shape)
        received = {k: torch.tensor(meta[k], dtype=torch.long) for k in ("images", "row_entry")}
        received["grids"] = torch.tensor(meta["grids"], dtype=torch.long).reshape(-1, 3)
        out.append({"pixels": pixels, **received})
    return out


class EngineRowExchange:
    """Rows (token lists, small) of an engine's tensor-parallel ranks to the engine's first rank, which hosts the
    one vLLM engine they share, and its results back: JSON broadcasts on the engine's own group (T is small)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = collective_device(dist.get_backend(group), device)
        self.ranks = dist.get_process_group_ranks(group)
        self.index = self.ranks.index(dist.get_rank())

    @property
    def is_leader(self) -> bool:
        return self.index == 0

    def to_leader(self, mine: object) -> list[object] | None:
        """Every rank's `mine`, in rank order, on the first rank (None elsewhere). Collective over the engine."""
        parts = [
            broadcast_json(mine if i == self.index else None, src, self.group, self.device)
            for i, src in enumerate(self.ranks)
        ]
        return parts if self.is_leader else None

    def to_all(self, mine: object) -> list[object]:
        """Every rank's `mine`, in rank order, on every rank of the engine (the in-process host: each tensor-parallel
        peer submits the same requests). Collective over the engine."""
        return [
            broadcast_json(mine if i == self.index else None, src, self.group, self.device)
            for i, src in enumerate(self.ranks)
        ]

    def any_rank(self, wants: bool) -> bool:
        """Whether any rank of the engine passed True; the same answer on each. Collective over the engine."""
        flag = torch.tensor([int(wants)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def from_leader(self, parts: list[object] | None) -> object:
        """The first rank's parts[i] on the engine's i-th rank. Collective over the engine."""
        every = broadcast_json(parts if self.is_leader else None, self.ranks[0], self.group, self.device)
        return every[self.index]  # type: ignore[index]


def group_timeout(group: dist.ProcessGroup, device: torch.device) -> timedelta | None:
    """The timeout the group's backend for `device` was created with (None when not exposed)."""
    try:
        return group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def wait_all(works: Sequence[dist.Work], group: dist.ProcessGroup, device: torch.device, what: str) -> None:
    """Wait for async collectives in issue order, each bounded by the group's timeout: a peer that
    never arrives raises (gloo raises on its own at the group timeout; the explicit timeout covers
    backends that would otherwise return False or block)."""
    timeout = group_timeout(group, device)
    for work in works:
        ok = work.wait(timeout) if timeout is not None else work.wait()
        if ok is False:
            raise RlrunError(f"{what} did not complete within its group's timeout ({timeout})")


class ReadyFlag:
    """The actor's first rank tells every engine rank that it has trained this step, without stopping either side:
    each step an engine posts one receive (arm), looks at it between chunks of generation (raised), and waits on it
    only when it has nothing left to do (wait, bounded by the group's timeout); the actor sends once per step
    (raise_). Point to point on the "ready" group (gloo, CPU tensors), so collectives on other groups go on."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        ranks = dist.get_process_group_ranks(group)
        self.source, self.engines = ranks[0], ranks[1:]
        self.buffer = torch.zeros(1)
        self.pending: dist.Work | None = None
        self.sends: list[dist.Work] = []

    def arm(self) -> None:
        self.wait()  # last step's flag: arrived long ago (the weight sync followed it)
        self.buffer.zero_()
        self.pending = dist.irecv(self.buffer, src=self.source, group=self.group)

    def raised(self) -> bool:
        # gloo fills the buffer as the message lands but marks its receive complete only in wait(): read the byte
        return self.pending is None or self.pending.is_completed() or bool(self.buffer[0] != 0)

    def wait(self) -> None:
        if self.pending is not None:
            wait_all([self.pending], self.group, torch.device("cpu"), "ready flag from the actor")
            self.pending = None

    def raise_(self) -> None:
        """On the actor's first rank: one send to each engine rank (the previous step's sends finished first)."""
        self.finish()
        # isend gives None only to a rank outside the group
        self.sends = cast("list[dist.Work]", [dist.isend(torch.ones(1), dst=r, group=self.group) for r in self.engines])

    def finish(self) -> None:
        """Every flag sent or received has completed (at the end of the run, before the groups go)."""
        self.wait()
        wait_all(self.sends, self.group, torch.device("cpu"), "ready flag to an engine")
        self.sends = []


# ---- node labels: every node's label (RLRUN_NODE_LABEL, else the host name), gathered once at start-up for
# --X_node_label

_WIDTH = MAX_NODE_LABEL_BYTES + 1  # one length byte, then the UTF-8 bytes


def encode_label(label: str) -> torch.Tensor:
    """label -> [_WIDTH] uint8: length, bytes, zero padding."""
    data = label.encode()
    if len(data) > MAX_NODE_LABEL_BYTES:
        raise LayoutError(f"node label {label[:40]!r}... is longer than {MAX_NODE_LABEL_BYTES} bytes")
    out = torch.zeros(_WIDTH, dtype=torch.uint8)
    out[0] = len(data)
    if data:
        out[1 : 1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def decode_label(row: torch.Tensor) -> str:
    """[_WIDTH] uint8 -> label."""
    values = row.tolist()
    return bytes(values[1 : 1 + values[0]]).decode()


def labels_per_node(rank_labels: list[str], ranks_per_node: int) -> tuple[str, ...]:
    """One label per node from one per rank (node n = ranks n*ranks_per_node ...); every rank of a node must
    report the same label. Pure, so every rank reaches the same answer or the same error."""
    nodes = []
    for node in range(len(rank_labels) // ranks_per_node):
        seen = rank_labels[node * ranks_per_node : (node + 1) * ranks_per_node]
        if len(set(seen)) != 1:
            raise LayoutError(
                f"the ranks of node {node} (ranks {node * ranks_per_node}-{(node + 1) * ranks_per_node - 1}) report "
                f"different node labels {seen}; set RLRUN_NODE_LABEL once per node, for all its processes"
            )
        nodes.append(seen[0])
    return tuple(nodes)


def gather_node_labels(label: str, ranks_per_node: int, device: torch.device) -> tuple[str, ...]:
    """All-gather every rank's label on the default group (the role groups do not exist yet); collective."""
    world = dist.group.WORLD
    assert world is not None  # the default group exists
    rows = all_gather_vectors(encode_label(label).to(device), world).cpu()
    return labels_per_node([decode_label(row) for row in rows], ranks_per_node)
