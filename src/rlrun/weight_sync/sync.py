"""Weight sync: the actor's weights to the engines after each update, by one of two mechanisms.

Colocated (engine ranks == actor ranks, rlrun.weight_sync.colocated): each rank writes its own gathers into its
engine; nothing else crosses the wire. Disaggregated, by default (rlrun.weight_sync.senders): every actor rank sends
its own shard to the engines' ranks on the many-senders group rlrun.launch made. Disaggregated from one rank
(rlrun.weight_sync.broadcast: an actor on one rank, a LoRA actor whose merged weights need whole adapters, a
placement the senders cannot describe, or --weight_sync_senders root): the actor's first rank gathers the model and
broadcasts byte buckets on the sync group. Both read the actor through a
ParamSource (rlrun.weight_sync.sources) and hand the engine what its receiver takes (rlrun.engines.receivers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from rlrun.config.generation import GenerationConfig
from rlrun.config.model import PretrainedConfig
from rlrun.engines.build import engine_dtype, fused_groups
from rlrun.engines.protocol import Engine
from rlrun.engines.receivers import WeightReceiver
from rlrun.launch.context import RankContext
from rlrun.launch.layout import Role
from rlrun.models.adapter_pretrain import lora_settings
from rlrun.models.lora import LoraSettings
from rlrun.runtime.log import get_logger
from rlrun.strategies.base import Strategy
from rlrun.weight_sync.broadcast import BroadcastSync
from rlrun.weight_sync.colocated import ColocatedSync
from rlrun.weight_sync.senders import ManySendersSync, agree_on_senders, sender_ranks
from rlrun.weight_sync.sources import AdapterParams, MergedLoraParams, ParamSource
from rlrun.weight_sync.wire import Traffic, WireFormat

if TYPE_CHECKING:  # annotations only: the messages themselves are the mechanisms'
    import torch.distributed as dist


class WeightSync(Protocol):
    """What the trainer holds: one call per update, on every actor and engine rank."""

    @property
    def num_buckets(self) -> int: ...

    traffic: Traffic  # what the last sync moved on this rank

    def sync(self) -> None:
        """Collective over the actor group (and, disaggregated, the sync group)."""


@dataclass(frozen=True)
class Route:
    """Where a sync goes. Colocated: each engine shares its actor rank. Otherwise over the groups rlrun.launch made:
    `root_group` ("sync": the actor's first rank and the receiving engine ranks) and, for an actor on several ranks,
    `senders_group` ("sync.senders": every actor rank and the receiving engine ranks); None on a rank outside it."""

    colocated: bool = False
    root_group: dist.ProcessGroup | None = None
    actor_ranks: tuple[int, ...] = (0,)
    senders_group: dist.ProcessGroup | None = None


def build_weight_sync(
    *,
    actor_params: ParamSource | None,
    receiver: WeightReceiver | None,
    route: Route,
    wire: WireFormat,
    device: torch.device,
    check_names: Sequence[str] = (),
) -> WeightSync:
    """This rank's side of the sync. actor_params: this rank's actor parameters (None off the actor's ranks).
    receiver: how this rank's engine takes each sync (rlrun.engines.protocol.Engine.weights); None off the engine
    ranks, and on an engine's ranks that its first rank takes the weights for. wire: the buckets' size, dtype, chunks
    and kept-together groups, the same on every rank. check_names: merged weights compared on both sides after every
    sync (LoRA). With a senders group, its ranks first agree whether every actor rank can send its own part."""
    if route.colocated:
        return ColocatedSync(actor_params, receiver, wire, device, check_names)
    if (group := route.senders_group) is not None and (len(route.actor_ranks) > 1 or wire.delta):
        senders, receivers = sender_ranks(group, route.actor_ranks)
        meta = agree_on_senders(actor_params, group, senders, device)
        if meta["blocker"] is None:
            return ManySendersSync(actor_params, receiver, group, senders, receivers, meta["params"], wire, device)
    root = route.actor_ranks[0]
    return BroadcastSync(actor_params, receiver, route.root_group, root, wire, device, check_names)


def policy_weight_sync(
    ctx: RankContext,
    model: PretrainedConfig,
    g: GenerationConfig,
    engine: Engine | None,
    actor: torch.nn.Module | None,
    strategy: Strategy | None,
    adapters: LoraSettings | None,
) -> WeightSync:
    """The actor's weights to the engines after each update (rlrun.ppo, rlrun.tinker); under LoRA its adapters alone
    where the engines run them beside their base weights (`adapters`: rlrun.engines.build.engine_adapters, the
    settings the engines were built with), else merged into the base weights. `actor` and `strategy`: this rank's
    trained policy and its strategy (None off the actor's ranks)."""
    lora = lora_settings(model)
    source: ParamSource | None = None
    if actor is not None:
        assert strategy is not None
        if lora is None:
            source = ParamSource(actor, strategy.param_blocks, strategy)
        elif adapters is not None:
            source = AdapterParams(actor, strategy.param_blocks)
        else:
            source = MergedLoraParams(actor, strategy.param_blocks, lora.scaling)
    if adapters is not None and ctx.rank == ctx.layout.ranks_of(Role.ACTOR)[0]:
        get_logger(ctx.rank).info_once(
            f"weight sync: LoRA adapters only (the {g.generation_backend} engines keep the base weights and run the "
            "adapters beside them)"
        )
    return build_weight_sync(
        actor_params=source,
        receiver=engine.weights if engine else None,
        route=Route(
            colocated=ctx.layout.engine_colocated_with_actor,
            root_group=ctx.groups.get("sync"),
            actor_ranks=ctx.layout.ranks_of(Role.ACTOR),
            senders_group=ctx.groups.get("sync.senders"),
        ),
        wire=WireFormat(
            bucket_bytes=g.weight_sync_bucket_mb * 2**20,
            dtype=engine_dtype(model.bf16, ctx.device),
            together=fused_groups if g.generation_backend == "native" else None,
            delta=g.weight_sync_delta,
        ),
        device=ctx.device,
        check_names=source.check_names() if isinstance(source, (MergedLoraParams, AdapterParams)) else (),
    )
