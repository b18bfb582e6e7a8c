"""Mixture-of-experts policies: finding the routers, recording and replaying their expert choices, and the
load-balancing loss.

transformers' MoE families (Qwen2-MoE, Qwen3-MoE, Mixtral; 5.x) route with a `*TopKRouter` module at `mlp.gate` of
each sparse layer: hidden [N, E] -> (logits [N, X], top-k weights [N, k], top-k expert ids [N, k]), N the call's
tokens in row-major order of its [rows, columns] input, X the experts. Everything here hooks those modules, so the
model's own forward (padded, packed, sequence-parallel, gradient-checkpointed) runs unchanged:
- `tapped(model)` records what each router chose (and its logits, for the auxiliary loss);
- `tapped(model, replay=ids)` makes each router pick the given experts instead (routing replay, verl's
  router_replay R3): the weights are the router's own softmax probabilities at those experts (renormalised as the
  model renormalises its top-k), so the router's parameters still get gradients; verl's R2 replays what the actor's
  own scoring forward recorded (`RoutingRun.recorded`) in its training passes.

Why replay: the engine that sampled a token and the trainer that scores it compute the router's logits with other
kernels (and often another precision); near a tie the top-k flips, that token goes through other experts, and its
log-prob under the trainer is not the one it was sampled with. Replaying the engine's choice removes that source of
mismatch (verl docs/advance/router_replay; slime, NeMo-RL and prime-rl do the same).

Routing on the wire and in a RolloutBatch is uint8 [rows, columns, layers, k] aligned with the token ids, NO_ROUTE
where a position has no recorded choice (padding, the last sampled token, which the engine never feeds back): the
router picks by itself there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

NO_ROUTE = 255  # a position whose routers choose by themselves
MAX_EXPERTS = NO_ROUTE  # expert ids must fit below the sentinel in uint8


def is_sparse_layer(config: Any, layer: int) -> bool:
    """Whether decoder layer `layer` of a model with this HF config routes to experts (Qwen2/3-MoE's
    mlp_only_layers and decoder_sparse_step; every layer of Mixtral)."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    return (
        bool(experts)
        and layer not in (getattr(config, "mlp_only_layers", None) or ())
        and (layer + 1) % (getattr(config, "decoder_sparse_step", 1) or 1) == 0
    )


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers in layer order (empty for a dense model)."""
    return [m for m in model.modules() if _is_router(m)]


def _is_router(module: nn.Module) -> bool:
    return type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k") and hasattr(module, "num_experts")


@dataclass(frozen=True)
class RoutingShape:
    """What a routing tensor of this model holds per token: `layers` routers of `top_k` choices among `experts`."""

    layers: int
    top_k: int
    experts: int


def routing_shape(model: nn.Module) -> RoutingShape | None:
    """None for a dense model."""
    found = routers(model)
    if not found:
        return None
    first: Any = found[0]
    return RoutingShape(len(found), int(first.top_k), int(first.num_experts))


def config_routing_shape(config: Any) -> RoutingShape | None:
    """What routing_shape(model) will be for a model with this HF config, known before any model is built (every
    rank sizes the rollout exchange's routing from it). None for a dense model."""
    layers = sum(is_sparse_layer(config, i) for i in range(int(getattr(config, "num_hidden_layers", 0) or 0)))
    if not layers:
        return None
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    return RoutingShape(layers, int(getattr(config, "num_experts_per_tok", 1) or 1), int(experts))


def renormalises(router: nn.Module) -> bool:
    """Whether the router divides its top-k probabilities by their sum: Qwen's `norm_topk_prob`, always for Mixtral
    (whose router has no such flag)."""
    return bool(getattr(router, "norm_topk_prob", True))


@dataclass
class Routed:
    """What one tapped forward's routers did, per layer (the first call of each router; a gradient-checkpointed
    recompute calls it again with the same inputs): logits [N, X] (with grad), the experts its own top-k picked
    [N, k], and the experts that ran [N, k] (the replayed ones where a replay was given)."""

    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    own: dict[int, torch.Tensor] = field(default_factory=dict)
    chosen: dict[int, torch.Tensor] = field(default_factory=dict)

    def chosen_ids(self) -> torch.Tensor:
        """[N, layers, k] uint8: the experts that ran, layer by layer."""
        return torch.stack([self.chosen[i] for i in sorted(self.chosen)], dim=1).to(torch.uint8)


def _replayed(router: nn.Module, logits: torch.Tensor, own: torch.Tensor, given: torch.Tensor) -> tuple:
    """(weights [N, k], ids [N, k]) when the tokens whose `given` row is not NO_ROUTE take those experts."""
    use = given[:, 0] != NO_ROUTE
    ids = torch.where(use[:, None], given.to(own.device, torch.long), own)
    probs = torch.softmax(logits.float(), dim=-1)
    weights = probs.gather(-1, ids)
    if renormalises(router):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@contextmanager
def tapped(model: nn.Module, replay: torch.Tensor | None = None) -> Iterator[Routed]:
    """Forwards of `model` inside record their routing into the yielded Routed; `replay` [N, layers, k] uint8
    (N the forward's tokens, row-major; NO_ROUTE rows route by themselves) makes each router take those experts."""
    found = routers(model)
    if replay is not None and replay.shape[1] != len(found):
        raise ValueError(f"routing replay has {replay.shape[1]} layers, the model {len(found)} routers")
    routed = Routed()
    handles = []
    for layer, router in enumerate(found):

        def hook(module: nn.Module, _args: tuple, out: tuple, layer: int = layer) -> tuple | None:
            logits, weights, own = out
            ids = own
            if replay is not None:
                given = replay[:, layer].to(own.device)
                if given.shape[0] != own.shape[0]:
                    raise ValueError(f"routing replay for {given.shape[0]} tokens, the forward has {own.shape[0]}")
                weights, ids = _replayed(module, logits, own, given)
                weights = weights.to(out[1].dtype)
            if layer not in routed.logits:
                routed.logits[layer], routed.own[layer], routed.chosen[layer] = logits, own.detach(), ids.detach()
            return None if replay is None else (logits, weights, ids)

        handles.append(router.register_forward_hook(hook))
    try:
        yield routed
    finally:
        for handle in handles:
            handle.remove()


def load_balancing_loss(routed: Routed, top_k: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The Switch-Transformer auxiliary loss as transformers' `load_balancing_loss_func` computes it (what OpenRLHF's
    --aux_loss_coef weights: the model's `aux_loss`): X * sum_x f_x P_x, f_x the fraction of (token, layer) top-k
    slots routed to expert x by the router's own top-k, P_x its mean probability, both over every layer's valid tokens
    pooled. valid [N] (True on real tokens; None: all)."""
    layers = [routed.logits[i] for i in sorted(routed.logits)]
    experts = layers[0].shape[-1]
    device = layers[0].device
    mask = torch.ones(layers[0].shape[0], device=device) if valid is None else valid.reshape(-1).to(device).float()
    counts = torch.zeros(experts, device=device)
    probs_sum = torch.zeros(experts, device=device)
    for logits in layers:
        probs = torch.softmax(logits.float(), dim=-1)
        picked = probs.topk(top_k, dim=-1).indices
        counts = counts.scatter_add(0, picked.reshape(-1), mask.repeat_interleave(top_k))
        probs_sum = probs_sum + (probs * mask[:, None]).sum(dim=0)
    rows = mask.sum() * len(layers)
    return experts * torch.sum((counts / rows) * (probs_sum / rows))


def expert_load(routed: Routed, valid: torch.Tensor | None = None) -> torch.Tensor:
    """[layers, X] the fraction of each layer's valid tokens' top-k slots that went to each expert (rows sum to 1):
    the per-layer expert load the metrics summarise."""
    rows = []
    for i in sorted(routed.chosen):
        ids = routed.chosen[i]
        experts = routed.logits[i].shape[-1]
        keep = torch.ones(ids.shape[0], dtype=torch.bool, device=ids.device) if valid is None else valid.reshape(-1)
        picked = ids[keep.to(ids.device)].reshape(-1)
        rows.append(torch.bincount(picked, minlength=experts).float() / max(picked.numel(), 1))
    return torch.stack(rows)


def mismatch_fraction(routed: Routed, replay: torch.Tensor) -> float:
    """Among the (token, layer) pairs with a recorded choice, the fraction whose router's own top-k set differs from
    the replayed one (what the trainer would have routed otherwise)."""
    differs, counted = 0, 0
    for layer in sorted(routed.own):
        given = replay[:, layer].to(routed.own[layer].device)
        use = given[:, 0] != NO_ROUTE
        own = routed.own[layer][use].sort(dim=-1).values
        rec = given[use].long().sort(dim=-1).values
        differs += int((own != rec).any(dim=-1).sum())
        counted += int(use.sum())
    return differs / counted if counted else 0.0


def pack_routing(
    routing: list[torch.Tensor], prompt_lens: list[int], width_prompt: int, width_response: int, shape: RoutingShape
) -> torch.Tensor:
    """Per-row routing [p_i + r_i, layers, k] uint8 -> [b, P + R, layers, k] aligned as rlrun.data.rollout.pack_rows
    lays the tokens out (prompt left-padded to P, response right-padded to R), NO_ROUTE elsewhere."""
    out = torch.full(
        (len(routing), width_prompt + width_response, shape.layers, shape.top_k), NO_ROUTE, dtype=torch.uint8
    )
    for i, (ids, p) in enumerate(zip(routing, prompt_lens)):
        r = ids.shape[0] - p
        out[i, width_prompt - p : width_prompt + r] = ids
    return out


def in_batch_order(chosen: torch.Tensor, shape: tuple[int, int], source: torch.Tensor | None) -> torch.Tensor:
    """The inverse of in_forward_order: a forward's routing [N, layers, k] -> [b, L, layers, k] (`shape` = (b, L)),
    from the padded rows flattened (source None) or the packed positions `source` ([n, W] flat indices into [b, L],
    -1 on padding). Positions no packed slot holds get NO_ROUTE."""
    rows, width = shape
    if source is None:
        return chosen.reshape(rows, width, *chosen.shape[1:]).clone()
    out = torch.full((rows * width, *chosen.shape[1:]), NO_ROUTE, dtype=chosen.dtype, device=chosen.device)
    index = source.reshape(-1).to(chosen.device)
    real = index >= 0
    out[index[real]] = chosen[real]
    return out.view(rows, width, *chosen.shape[1:])


def in_forward_order(routing: torch.Tensor | None, source: torch.Tensor | None) -> torch.Tensor | None:
    """A batch's routing [b, L, layers, k] -> [N, layers, k] in the order a forward's routers see the tokens: the
    padded [b, L] rows flattened (source None), or the packed positions `source` ([n, W] flat indices into [b, L],
    -1 on padding, which gets NO_ROUTE). None stays None."""
    if routing is None:
        return None
    flat = routing.reshape(-1, *routing.shape[2:])
    if source is None:
        return flat
    index = source.reshape(-1).to(flat.device)
    picked = flat[index.clamp(min=0)]
    picked[index < 0] = NO_ROUTE
    return picked


@dataclass
class RoutingRun:
    """One role's forward of a MoE policy: whether it replays the batch's recorded routing (--router_replay R2/R3),
    and, after the forward, what its routers did (`routed`), over which tokens (`valid` [N] bool), against which
    recorded choices (`given` [N, layers, k], None when the batch has none) and, for a packed forward, where its
    tokens sit in the rows (`source` [n, W], rlrun.data.packing; None: the padded rows flattened)."""

    replay: bool
    routed: Routed | None = None
    valid: torch.Tensor | None = None
    given: torch.Tensor | None = None
    source: torch.Tensor | None = None

    @contextmanager
    def around(
        self, model: nn.Module, given: torch.Tensor | None, valid: torch.Tensor, source: torch.Tensor | None = None
    ) -> Iterator[None]:
        """The model's forward inside runs tapped (replaying `given` when self.replay)."""
        with tapped(model, replay=given if self.replay else None) as routed:
            yield
        self.routed, self.valid, self.given, self.source = routed, valid.reshape(-1), given, source

    def recorded(self, shape: tuple[int, int]) -> torch.Tensor:
        """The experts the forward's tokens went through, laid out as its rows' tokens: [b, L, layers, k] uint8
        (`shape` = (b, L)), NO_ROUTE on padding (what --router_replay R2 replays in the later passes)."""
        assert self.routed is not None and self.valid is not None, "RoutingRun.recorded before a forward"
        chosen = self.routed.chosen_ids()
        if self.source is None:  # padded rows: their padding went through the routers too
            chosen = chosen.masked_fill(~self.valid.to(chosen.device)[:, None, None], NO_ROUTE)
        return in_batch_order(chosen, shape, self.source).cpu()

    def metrics(self, top_k: int) -> tuple[torch.Tensor, dict[str, float]]:
        """(the load-balancing loss of the forward, with grad; its numbers: moe/aux_loss, moe/max_expert_load (the
        most loaded expert's share of its layer, averaged over layers: 1 / experts when balanced) and per sparse
        layer (moe/max_expert_load/sparse_layer_I, the I-th layer that routes), and with
        recorded routing moe/router_mismatch_frac, the fraction of (token, layer) routings the trainer's router would
        have chosen otherwise)."""
        assert self.routed is not None, "RoutingRun.metrics before a forward"
        aux = load_balancing_loss(self.routed, top_k, self.valid)
        load = expert_load(self.routed, self.valid)
        per_layer = load.max(dim=-1).values  # [layers]
        numbers = {"moe/aux_loss": float(aux.detach()), "moe/max_expert_load": float(per_layer.mean())}
        numbers |= {f"moe/max_expert_load/sparse_layer_{i}": float(v) for i, v in enumerate(per_layer.tolist())}
        if self.given is not None:
            numbers["moe/router_mismatch_frac"] = mismatch_fraction(self.routed, self.given)
        return aux, numbers


@contextmanager
def recorded_calls(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Every forward of `model` inside appends its routing, [N, layers, k] uint8 (N its tokens, row-major), to the
    yielded list: an engine's prefill and each decode step, one entry per call."""
    found = routers(model)
    calls: list[torch.Tensor] = []
    pending: list[torch.Tensor] = []

    def hook(_module: nn.Module, _args: tuple, out: tuple) -> None:
        pending.append(out[2].detach().to(torch.uint8))
        if len(pending) == len(found):  # the call's last router
            calls.append(torch.stack(pending, dim=1).cpu())
            pending.clear()

    handles = [router.register_forward_hook(hook) for router in found]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def engine_routing(calls: list[torch.Tensor], rows: int, prompt_lens: list[int], response_lens: list[int]) -> list:
    """An HF-generate engine's recorded calls (the prefill over [rows, W] left-padded prompts, then one decode step
    per new token) -> per row [p_i + r_i, layers, k] uint8: its prompt tokens' routing and its response tokens' (the
    token sampled at step t is fed, and routed, at step t + 1; a token never fed gets NO_ROUTE)."""
    prefill = calls[0].view(rows, -1, *calls[0].shape[1:])
    width, per_token = prefill.shape[1], prefill.shape[2:]
    steps = len(calls) - 1  # [rows, steps, layers, k]: step t's fed token is response token t
    decoded = torch.stack(calls[1:], dim=1) if steps else prefill.new_empty((rows, 0, *per_token))
    out = []
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        never_fed = torch.full((max(r - steps, 0), *per_token), NO_ROUTE, dtype=torch.uint8)
        out.append(torch.cat([prefill[i, width - p :], decoded[i, :r], never_fed]))
    return out
