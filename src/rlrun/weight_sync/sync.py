"""Weight sync: the actor's weights to the engines after each update, by one of two mechanisms.

Colocated (engine ranks == actor ranks, rlrun.weight_sync.colocated): each rank writes its own gathers into its
engine; nothing else crosses the wire. Disaggregated (rlrun.weight_sync.broadcast): the actor's first rank
broadcasts byte buckets to the engines' ranks on the sync group rlrun.launch made. Both read the actor through a
ParamSource (rlrun.weight_sync.sources) and hand the engine what its receiver takes (rlrun.engines.receivers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from rlrun.engines.receivers import WeightReceiver
from rlrun.weight_sync.broadcast import BroadcastSync
from rlrun.weight_sync.colocated import ColocatedSync
from rlrun.weight_sync.sources import ParamSource
from rlrun.weight_sync.wire import WireFormat

if TYPE_CHECKING:  # annotations only: the broadcasts themselves are BroadcastSync's
    import torch.distributed as dist


class WeightSync(Protocol):
    """What the trainer holds: one call per update, on every actor and engine rank."""

    @property
    def num_buckets(self) -> int: ...

    def sync(self) -> None:
        """Collective over the actor group (and, disaggregated, the sync group)."""


def build_weight_sync(
    *,
    actor_params: ParamSource | None,
    receiver: WeightReceiver | None,
    sync_group: dist.ProcessGroup | None,
    actor_root: int,
    colocated: bool,
    wire: WireFormat,
    device: torch.device,
    check_names: Sequence[str] = (),
) -> WeightSync:
    """This rank's side of the sync. actor_params: this rank's actor parameters (None off the actor's ranks).
    receiver: how this rank's engine takes each sync (rlrun.engines.protocol.Engine.weights); None off the engine
    ranks, and on an engine's ranks that its first rank takes the weights for. sync_group (disaggregated only): the
    root and the receiving engine ranks. wire: the buckets' size, dtype, chunks and kept-together groups, the same
    on every rank. check_names: merged weights compared on both sides after every sync (LoRA)."""
    if colocated:
        return ColocatedSync(actor_params, receiver, wire, device, check_names)
    return BroadcastSync(actor_params, receiver, sync_group, actor_root, wire, device, check_names)
