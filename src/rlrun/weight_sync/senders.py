"""Weight sync from every actor rank: each sends only what it holds of each parameter (its FSDP2 or ZeRO-3 shard;
its share of a tensor every actor rank holds whole), cast to the engines' dtype before it moves. No rank gathers the
model, and no actor rank sends more than its part, whatever the number of engines.

The plan (the same on every rank, from the first actor rank's metadata, agreed once at construction). Both sides pack
the parameters into the root path's buckets (rlrun.engines.receivers.pack_buckets), so an engine's receive buffers
are the same as there. Within bucket k, actor rank i's elements of each parameter in it, back to back in the bucket's
order, are its stripe (k, i): one point-to-point message. Stripe (k, i) goes to engine rank i mod E (E receiving
engine ranks). With one engine rank that is all (direct); with several (striped), every engine rank then sends the
stripes it took on to the other engine ranks, so an actor rank's link carries its shard once per sync and the engine
ranks exchange the rest among themselves. Each engine rank takes a bucket's stripes into one receive staging buffer
and copies each piece into its place in the bucket: an engine that keeps the weights (KeptModel) has its parameters
as views into per-bucket buffers, as on the root path; a BucketSink gets each bucket in one of two staging buffers.

An actor rank double-buffers its stripes (two stripe-sized buffers, about a bucket / actor ranks each): it packs
stripe k + 1 while stripe k is on the wire, and refills a buffer once its previous stripe arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from rlrun.engines.receivers import BucketEntry, BucketSink, KeptModel, WeightReceiver, entry_view, pack_buckets
from rlrun.launch.transfer import broadcast_json, wait_all
from rlrun.runtime.errors import RlrunError
from rlrun.runtime.log import get_logger
from rlrun.strategies.blocks import Holding
from rlrun.weight_sync.buckets import bind_engine_views, check_engine_matches, two_staging
from rlrun.weight_sync.delta import DENSE, apply_changes, changes, checksum, header, positions
from rlrun.weight_sync.sources import ParamSource
from rlrun.weight_sync.wire import Traffic, WireFormat

Spans = list[tuple[int, int, int]]  # (global rank, first element, end element) of a parameter's parts


@dataclass(frozen=True)
class Stripe:
    """What one actor rank sends of one bucket: its elements of each parameter in it, back to back."""

    sender: int  # global rank
    pieces: tuple[tuple[BucketEntry, int, int], ...]  # (entry, first element, end element), in bucket order

    @property
    def numel(self) -> int:
        return sum(end - begin for _, begin, end in self.pieces)


@dataclass(frozen=True)
class Taking:
    """Stripes whose first receives are posted (rlrun.weight_sync.senders.ManySendersSync._post_take)."""

    stripes: list[Stripe]
    places: dict[int, torch.Tensor]  # sender -> where its stripe lands when it comes dense
    source: Callable[[Stripe], int]  # the rank each stripe comes from
    works: list[dist.Work]
    firsts: dict[int, torch.Tensor]  # sender -> its first message (dense: its place; delta: its header)


def agree_on_senders(
    actor_params: ParamSource | None, group: dist.ProcessGroup, senders: tuple[int, ...], device: torch.device
) -> dict[str, Any]:
    """The first actor rank's parameter list ([name, shape, spans] in its gather order), or why the actor's ranks
    cannot each send their own part ({"blocker": ...}), on every rank of `group` (one broadcast)."""
    meta: dict[str, Any] | None = None
    if dist.get_rank() == senders[0]:
        assert actor_params is not None
        blocker = actor_params.senders_blocker(senders)
        params = [] if blocker else [[h.name, list(h.shape), h.spans] for h in actor_params.holdings(senders)]
        meta = {"blocker": blocker, "params": params}
        if blocker is not None:
            get_logger(senders[0]).info_once(f"weight sync: from the actor's first rank ({blocker})")
    return cast("dict[str, Any]", broadcast_json(meta, senders[0], group, device))


def plan_stripes(
    buckets: list[list[BucketEntry]], spans: dict[str, Spans], senders: tuple[int, ...]
) -> list[list[Stripe]]:
    """Per bucket, each sender's stripe in sender order (a sender that holds nothing of a bucket has none)."""
    plan = []
    for bucket in buckets:
        stripes = []
        for sender in senders:
            pieces = tuple((e, begin, end) for e in bucket for r, begin, end in spans[e.name] if r == sender)
            if pieces:
                stripes.append(Stripe(sender, pieces))
        plan.append(stripes)
    return plan


def stripe_buffers(stripes: list[list[Stripe]], sender: int) -> list[int]:
    """The elements of `sender`'s two stripe buffers (its stripes alternate between them; one if it has one)."""
    sizes = [s.numel for bucket in stripes for s in bucket if s.sender == sender]
    return [max(sizes[i::2]) for i in range(min(2, len(sizes)))]


def receive_staging(stripes: list[list[Stripe]]) -> int:
    """The elements of an engine rank's receive staging: the stripes of its largest bucket."""
    return max(sum(s.numel for s in bucket) for bucket in stripes)


class ManySendersSync:
    """The actor's weights from all its ranks to the engines' ranks, after each update (module docstring)."""

    def __init__(
        self,
        actor_params: ParamSource | None,
        receiver: WeightReceiver | None,
        group: dist.ProcessGroup,
        senders: tuple[int, ...],
        receivers: tuple[int, ...],
        params: list[list[Any]],
        wire: WireFormat,
        device: torch.device,
    ) -> None:
        """Every rank of `group` (the actor's ranks `senders`, the engines' receiving ranks `receivers`); `params`:
        agree_on_senders' list."""
        self.actor_params, self.group, self.device = actor_params, group, device
        self.senders, self.receivers = senders, receivers
        self.rank = dist.get_rank()
        self.sink = receiver if isinstance(receiver, BucketSink) else None
        has_model = isinstance(receiver, (KeptModel, BucketSink)) and self.rank in receivers
        self.engine_model: nn.Module | None = receiver.model if has_model else None  # type: ignore[union-attr]
        if self.engine_model is not None:
            check_engine_matches(self.engine_model, params)
        names = [n for n, _, _ in params]
        groups = wire.together(names) if wire.together is not None else ()
        self.buckets = pack_buckets([(n, torch.Size(s), wire.dtype) for n, s, _ in params], wire.bucket_bytes, groups)
        self.stripes = plan_stripes(self.buckets, {n: [tuple(s) for s in spans] for n, _, spans in params}, senders)
        self.traffic = Traffic()
        self.dtype = wire.dtype
        self.buffers: list[torch.Tensor] = []  # engines: their bucket buffers (one per bucket, or a sink's two)
        self.staging: list[torch.Tensor] = []  # actor ranks: two stripe buffers; engines: one bucket's stripes
        self.delta = wire.delta and self._all_take_deltas(receiver)
        self.first = True  # the first sync is dense: the engines' copies are not the actor's yet
        self._packed: tuple[list[Holding], list[tuple[list[torch.Tensor], list[torch.Tensor]]]] | None = None
        self.mine = [s for stripes in self.stripes for s in stripes if s.sender == self.rank]
        self.last_at = [sum(s.numel for s in self.mine[:i]) for i in range(len(self.mine))]
        # delta: a copy of what this rank sent last, in the wire dtype (its shard)
        self.last = torch.empty(sum(s.numel for s in self.mine) if self.delta else 0, dtype=self.dtype, device=device)
        if self.rank in senders:
            assert actor_params is not None
            self._check_holdings(actor_params, params)
            sizes = stripe_buffers(self.stripes, self.rank)
            self.staging = [torch.empty(n, dtype=self.dtype, device=device) for n in sizes]
            if self.rank == senders[0]:
                get_logger(self.rank).info_once(self.describe())
        elif self.engine_model is not None:
            self.buffers = (
                two_staging(self.buckets, device)
                if self.sink is not None
                else bind_engine_views(self.engine_model, self.buckets, device)
            )
            # two: bucket k + 1's stripes arrive while bucket k's are passed on and placed
            count = min(2, len(self.stripes))
            size = receive_staging(self.stripes)
            self.staging = [torch.empty(size, dtype=wire.dtype, device=device) for _ in range(count)]
            # made once (views cost more than the copies through them): per bucket, where each stripe arrives and,
            # per stripe, its pieces' sources there and targets in the bucket buffer
            self.places = [self._places(k) for k in range(len(self.stripes))]
            self.pieces = [[self._piece_views(k, s) for s in stripes] for k, stripes in enumerate(self.stripes)]

    def _all_take_deltas(self, receiver: WeightReceiver | None) -> bool:
        """Whether every receiving engine rank keeps the weights between syncs (a delta is applied to them); one
        all-reduce over the group. A BucketSink (vLLM) hands each sync on and keeps no copy: full syncs then."""
        takes = self.rank not in self.receivers or isinstance(receiver, KeptModel)
        flag = torch.tensor([1 if takes else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        if not flag.item() and self.rank == self.senders[0]:
            get_logger(self.rank).info_once(
                "weight sync: --weight_sync_delta needs engines that keep the weights "
                "between syncs (vLLM's do not): every sync is full"
            )
        return bool(flag.item())

    def _check_holdings(self, actor_params: ParamSource, params: list[list[Any]]) -> None:
        """This rank holds what the plan says it sends (the first actor rank's view of the placement)."""
        held = {h.name: h for h in actor_params.holdings(self.senders)}
        for name, _, spans in params:
            for r, begin, end in spans:
                if r == self.rank and (name not in held or not held[name].start <= begin <= end <= held[name].stop):
                    raise RlrunError(
                        f"weight sync: actor rank {self.rank} does not hold elements [{begin}, {end}) of {name}, "
                        "which the first actor rank's placement gives it: the actor's ranks shard the model differently"
                    )

    def describe(self) -> str:
        """The start-up line: who sends what to whom."""
        e, a = len(self.receivers), len(self.senders)
        fan = (
            "direct"
            if e == 1
            else f"striped: each engine rank takes the shards of {-(-a // e)} actor rank(s) and passes them on "
            "to the other engine ranks"
        )
        mine = max(sum(s.numel for ss in self.stripes for s in ss if s.sender == r) for r in self.senders)
        total = sum(s.numel for ss in self.stripes for s in ss)
        size = self.dtype.itemsize
        return (
            f"weight sync: many senders: each of the {a} actor ranks sends its own shard in {self.dtype} "
            f"(at most {mine * size / 2**20:.1f} MiB of the model's {total * size / 2**20:.1f} MiB) to {e} engine "
            f"rank(s), {fan}" + ("; delta: only the elements changed since the last sync" if self.delta else "")
        )

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def sync(self) -> None:
        """Collective over the group: every actor rank and every receiving engine rank calls it."""
        self.traffic = Traffic()
        if self.actor_params is not None and self.rank in self.senders:
            self._send(self.actor_params)
        elif self.engine_model is not None:
            self._receive()

    def _post(self, op: Callable[..., dist.Work | None], tensor: torch.Tensor, peer: int) -> dist.Work:
        """An isend or irecv with `peer` (a global rank of the group)."""
        work = op(tensor, peer, group=self.group)
        assert work is not None, "both ends of a weight-sync message are in its group"
        return work

    def _direct(self, sender: int) -> int:
        return self.receivers[self.senders.index(sender) % len(self.receivers)]

    def _send(self, actor_params: ParamSource) -> None:
        """Pack each of this rank's stripes (cast to the wire dtype as it is copied) and post it to its engine rank
        (delta: its changes since the last sync, or the stripe when they are as large); a staging buffer is refilled
        once the stripe before it in that buffer arrived."""
        packing = self._packing(actor_params.holdings(self.senders))
        pending: list[list[dist.Work]] = [[], []]
        kept: list[list[torch.Tensor]] = [[], []]  # what each buffer's sends read, alive until they complete
        with torch.no_grad():
            for i, (stripe, at_last, (sources, targets)) in enumerate(zip(self.mine, self.last_at, packing)):
                wait_all(pending[i % 2], self.group, self.device, "weight sync: a stripe to an engine rank")
                buffer = self.staging[i % 2][: stripe.numel]
                for target, source in zip(targets, sources):  # not _foreach_copy_: its CUDA fast path has cast mixed
                    target.copy_(source)  # source dtypes wrongly (pytorch 173383), and a unit may mix fp32 and bf16
                kept[i % 2] = self._encode(buffer, at_last) if self.delta else [buffer]
                pending[i % 2] = [self._post(dist.isend, m, self._direct(self.rank)) for m in kept[i % 2]]
                self.traffic.sent += sum(m.numel() * m.element_size() for m in kept[i % 2])
        wait_all(pending[0] + pending[1], self.group, self.device, "weight sync: a stripe to an engine rank")
        self.first = False

    def _packing(self, held: list[Holding]) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """Per stripe of this rank: (its pieces in this rank's parameters, their places in the stripe's staging
        buffer). Made again only when the parameters moved (ParamSource.holdings gives a new list then)."""
        if self._packed is None or self._packed[0] is not held:
            by_name = {h.name: h for h in held}
            plan = []
            for i, stripe in enumerate(self.mine):
                sources, targets, at = [], [], 0
                for e, begin, end in stripe.pieces:
                    sources.append(by_name[e.name].piece(begin, end))
                    targets.append(self.staging[i % 2][at : at + end - begin])
                    at += end - begin
                plan.append((sources, targets))
            self._packed = (held, plan)
        return self._packed[1]

    def _encode(self, stripe: torch.Tensor, at_last: int) -> list[torch.Tensor]:
        """A stripe's messages in delta mode: its header, then its changed elements since this rank's last sync (gaps,
        values) or the whole stripe (the first sync; or when the changes are as large). Updates the kept copy."""
        last = self.last[at_last : at_last + stripe.numel()]
        found = None if self.first else changes(stripe, last)
        last.copy_(stripe)
        total = checksum(stripe)
        if found is None:
            return [header(DENSE, total, self.device), stripe]
        index, values = found
        return [header(index.numel(), total, self.device), *([index, values] if index.numel() else [])]

    def _post_take(
        self, stripes: list[Stripe], places: dict[int, torch.Tensor], source: Callable[[Stripe], int]
    ) -> Taking:
        """Post the first receive of each stripe, from its `source` (dense: the stripe into its place; delta: its
        header); _finish_take completes them."""
        firsts = {s.sender: self._first(places[s.sender]) for s in stripes}
        works = [self._post(dist.irecv, firsts[s.sender], source(s)) for s in stripes]
        return Taking(stripes, places, source, works, firsts)

    def _finish_take(self, taking: Taking) -> dict[int, list[torch.Tensor]]:
        """The stripes' messages by sender, once arrived (delta: the bodies their headers announce, posted at once)."""
        stripes, places, source, firsts = taking.stripes, taking.places, taking.source, taking.firsts
        what = "weight sync: a stripe from an actor rank or another engine rank"
        wait_all(taking.works, self.group, self.device, what)
        got = {s.sender: [firsts[s.sender], *self._bodies(firsts[s.sender], places[s.sender])] for s in stripes}
        bodies = [self._post(dist.irecv, m, source(s)) for s in stripes for m in got[s.sender][1:]]
        wait_all(bodies, self.group, self.device, what)
        return got

    def _first(self, place: torch.Tensor) -> torch.Tensor:
        """Where a stripe's first message arrives: the stripe itself into its place, or (delta) its header."""
        return torch.empty(2, dtype=torch.int64, device=self.device) if self.delta else place

    def _bodies(self, first: torch.Tensor, place: torch.Tensor) -> list[torch.Tensor]:
        """Where the messages after a stripe's first arrive: none (dense: the first was the stripe); delta: what its
        header announces (the whole stripe into its place, or its changes into new tensors; nothing when none
        changed)."""
        if not self.delta:
            return []
        count = int(first[0])
        if count == DENSE:
            return [place]
        return [torch.empty(count, dtype=torch.int16, device=self.device), place.new_empty(count)] if count else []

    def _exchange(self, sends: list[tuple[torch.Tensor, int]], receives: list[tuple[torch.Tensor, int]]) -> None:
        """Point-to-point messages both ways between engine ranks, issued as one batch: NCCL runs a pair's sends and
        receives on one stream, so two ranks that each sent first would wait for each other (batch_isend_irecv
        groups them); gloo issues them one by one."""
        ops = [dist.P2POp(dist.isend, t, peer, self.group) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, self.group) for t, peer in receives]
        if ops:
            works = dist.batch_isend_irecv(ops)
            wait_all(works, self.group, self.device, "weight sync: stripes between engine ranks")

    def _pass_on(self, k: int, mine: list[Stripe], got: dict[int, list[torch.Tensor]]) -> None:
        """Bucket k among the engine ranks: each sends every other the stripes it took from its actor ranks and
        receives theirs (the first messages, then what delta's headers announce), into `got` by sender."""
        others = [r for r in self.receivers if r != self.rank]
        passed = [s for s in self.stripes[k] if s.sender not in got]
        places = self.places[k]
        firsts = {s.sender: self._first(places[s.sender]) for s in passed}
        sends = [(got[s.sender][0], other) for other in others for s in mine]
        self._exchange(sends, [(firsts[s.sender], self._direct(s.sender)) for s in passed])
        got.update((s.sender, [firsts[s.sender], *self._bodies(firsts[s.sender], places[s.sender])]) for s in passed)
        sends = [(m, other) for other in others for s in mine for m in got[s.sender][1:]]
        self._exchange(sends, [(m, self._direct(s.sender)) for s in passed for m in got[s.sender][1:]])

    def _places(self, k: int) -> dict[int, torch.Tensor]:
        """Where bucket k's stripes arrive: back to back in the receive staging of its parity."""
        staging, at, places = self.staging[k % len(self.staging)], 0, {}
        for s in self.stripes[k]:
            places[s.sender] = staging[at : at + s.numel]
            at += s.numel
        return places

    def _bucket_buffer(self, k: int) -> torch.Tensor:
        """Bucket k's buffer on an engine rank: its own (kept weights), or a sink's staging buffer of its parity."""
        return self.buffers[k % 2] if self.sink is not None else self.buffers[k]

    def _piece_views(self, k: int, stripe: Stripe) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(each piece in the stripe's place, each piece in bucket k's buffer), as flat views."""
        buffer = self._bucket_buffer(k)
        place, at, sources, targets = self.places[k][stripe.sender], 0, [], []
        for e, begin, end in stripe.pieces:
            sources.append(place[at : at + end - begin])
            targets.append(entry_view(buffer, e).view(-1)[begin:end])
            at += end - begin
        return sources, targets

    def _receive(self) -> None:
        """Bucket by bucket: this rank's stripes from their actor ranks (bucket k + 1's posted while bucket k is
        passed on and placed), then the exchange with the other engine ranks (each sends on what it took), then
        every piece into its place in the bucket. Delta: each stripe's checksum is compared with the engine's copy
        after the update, and a mismatch raises once the sync is over (the other ranks are not left waiting)."""
        assert self.engine_model is not None
        if self.sink is not None:
            self.sink.start(self.buckets, self.buffers)
        wrong: list[str] = []

        def direct(k: int) -> list[Stripe]:
            return [s for s in self.stripes[k] if self._direct(s.sender) == self.rank]

        ahead = self._post_take(direct(0), self.places[0], lambda s: s.sender)
        for k, stripes in enumerate(self.stripes):
            mine = direct(k)
            got = self._finish_take(ahead)
            if k + 1 < len(self.stripes):
                ahead = self._post_take(direct(k + 1), self.places[k + 1], lambda s: s.sender)
            self._pass_on(k, mine, got)
            self.traffic.received += sum(m.numel() * m.element_size() for ms in got.values() for m in ms)
            self.traffic.sent += sum(m.numel() * m.element_size() for s in mine for m in got[s.sender]) * (
                len(self.receivers) - 1
            )
            if self.sink is not None and k >= 2:
                self.sink.release(k - 2)
            buffer = self._bucket_buffer(k)
            for s, (sources, targets) in zip(stripes, self.pieces[k]):
                self._apply(buffer, s, got[s.sender], sources, targets)
                if self.delta and sum(map(checksum, targets)) != int(got[s.sender][0][1]):
                    wrong.append(
                        f"bucket {k}, actor rank {s.sender}'s part ({', '.join(e.name for e, _, _ in s.pieces[:3])})"
                    )
            if self.sink is not None:
                self.sink.take(k)
        if self.sink is not None:
            self.sink.finish()
        if wrong:
            raise RlrunError(
                f"weight sync: after a delta sync engine rank {self.rank}'s weights differ from the actor's in "
                f"{len(wrong)} part(s), first {wrong[0]}: its copy changed since the last sync (or an update was "
                "lost); run without --weight_sync_delta to send every weight each sync"
            )

    def _apply(
        self,
        buffer: torch.Tensor,
        stripe: Stripe,
        got: list[torch.Tensor],
        sources: list[torch.Tensor],
        targets: list[torch.Tensor],
    ) -> None:
        """A stripe's messages into the bucket `buffer`: the whole stripe piece by piece (it arrived where `sources`
        view it), or its changes (delta: gaps and values after the header; none when nothing changed)."""
        if self.delta and int(got[0][0]) != DENSE:
            if len(got) == 3:
                apply_changes(buffer, stripe.pieces, positions(got[1]), got[2])
            return
        torch._foreach_copy_(targets, sources)


def sender_ranks(group: dist.ProcessGroup, actor_ranks: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the actor's ranks, the engines' receiving ranks) of a many-senders group, in its rank order."""
    members = dist.get_process_group_ranks(group)
    return tuple(r for r in members if r in actor_ranks), tuple(r for r in members if r not in actor_ranks)
