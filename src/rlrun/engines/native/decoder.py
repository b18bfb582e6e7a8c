"""A lean KV-cache forward for Llama-family causal LMs (Llama, Qwen2, Qwen3, Mistral), on the HF model's own weights.

Why: for the model sizes RL runs on a CPU, and for every model at small batch, transformers' `generate` spends
most of a decode step outside the matmuls (cache objects, mask builders, logits processors, module hooks, and
dozens of tiny tensor ops per layer). This module runs the same arithmetic as the HF modules with as few ops as
it can:
- the query/key/value and gate/up projections run as one matmul each, over one tensor per group that IS the HF
  parameters' memory: at start the decoder lays each group's parameters out back to back in one storage (each
  parameter a view into it), and weight sync lays its receive buffers out the same way (`fused_groups`), so no
  weight is held twice; where a group's parameters do not lie back to back (a caller re-pointed them elsewhere),
  a call joins them into a copy for its own duration;
- the rotary embedding is one complex multiply over each head's features paired as HF's rotate-half pairs them
  (j with j + D/2, read from the projection's output in that order); queries and keys are paired alike, so every
  attention score is the same dot product (summed in another order);
- one decode step's attention is a baddbmm + softmax + bmm over the cache (scores and softmax in fp32, as the
  fused attention kernels compute them), with the padding mask built once per step for all layers;
- a decode step can also run with static shapes (`decode(..., slot=)`: the cache written at a position given as a
  tensor, attention over the whole capacity under the mask), the step a CUDA graph captures (rlrun.engines.native).
The HF model stays the source of truth: nothing here is trained or saved, and the decoder holds no weight of its own
between calls (`Decoder.weights()` reads them at the start of each). A LoRA policy's adapters can run beside the base
projections as PEFT runs them, base(x) + scaling * B(A(x)) (`Adapters`): weight sync then sends the adapters alone.

Shapes: B rows, W prompt width (left-padded), S new positions, T cached positions (after the new ones), C cache
capacity, H query heads, K key/value heads, G = H / K, D head dim, E hidden size, I intermediate size, V vocab.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from rlrun.engines.receivers import adapter_module
from rlrun.models.architecture import is_vision_language
from rlrun.models.moe import renormalises

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral")
_QK_NORM_TYPES = ("qwen3", "qwen3_moe")


def unsupported_reason(config: object, max_len: int) -> str | None:
    """Why the decoder cannot run a model with this HF config for sequences of `max_len` tokens (None: it can)."""
    model_type = getattr(config, "model_type", None)
    if is_vision_language(config):  # type: ignore[arg-type]
        return f"{model_type!r} is a vision-language model (the native engine decodes text-only models)"
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} (the native engine runs {', '.join(SUPPORTED_MODEL_TYPES)})"
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        return f"hidden_act {act!r} (the native engine runs silu)"
    if (getattr(config, "pretraining_tp", 1) or 1) > 1:
        return f"pretraining_tp {config.pretraining_tp}"  # type: ignore[attr-defined]
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) and window is not None and window < max_len:
        return f"sliding_window {window} < {max_len} tokens per sequence (the native engine attends to every position)"
    return None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm, op for op: the statistics in fp32, the result cast back before the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """One decode step's attention per (row, key/value head) N: q [N, G, D], keys and values [N, T, D] in the model's
    dtype, bias [N, 1, T] fp32 (0 or -inf) -> [N, G, D] in the model's dtype.

    Scores and softmax in fp32 whatever the model's dtype, as the fused kernels behind the actor's forward (SDPA,
    flash-attn) keep them: a bf16 score keeps 8 significant bits (steps of 1/16 at magnitudes 8-16), which would
    move each attention probability by up to ~3%, and the log-probs the engine reports with them. (HF's eager
    attention rounds the scores to bf16 as the matmul's output; SDPA and flash-attn do not.) The probabilities are
    then cast to the model's dtype for the value product, summed in fp32 by the matmul, as flash-attn does."""
    scores = torch.baddbmm(bias, q.float(), keys.float().transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(scores, dim=-1).to(q.dtype), values)


def fused_groups(names: Iterable[str]) -> list[list[str]]:
    """The parameter names (of the HF model's `named_parameters`) whose tensors the decoder runs as one matmul, per
    group in the order it joins them: each layer's q/k/v projections' weights, their biases, the MLP's gate/up
    weights and their biases. Weight sync keeps each group back to back in its buckets, so the engine's
    parameters there are what the decoder runs on. Names of other architectures match no group."""
    present = set(names)
    groups = []
    for name in present:
        for first, rest in (
            ("self_attn.q_proj.", ("self_attn.k_proj.", "self_attn.v_proj.")),
            ("mlp.gate_proj.", ("mlp.up_proj.",)),
        ):
            head, found, kind = name.rpartition(first)
            if found and kind in ("weight", "bias"):
                group = [name] + [head + other + kind for other in rest]
                if all(n in present for n in group):
                    groups.append(group)
    return sorted(groups)


# ---- LoRA adapters beside the base projections ------------------------------------------------------------------
# Named as the actor's adapters under the base model's module names (rlrun.weight_sync.sources.AdapterParams).

ADAPTED = re.compile(
    r"^model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)\.lora_([AB])\.default\.weight$"
)
ADAPTABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # --target_modules it runs


def adapter_blocker(names: Iterable[str]) -> str | None:
    """Why the decoder cannot run adapters with these parameter names (None: it can)."""
    other = [n for n in names if not ADAPTED.match(n)]
    return None if not other else f"adapters outside a decoder layer's attention and dense MLP projections: {other[0]}"


class Adapters:
    """LoRA adapters the decoder adds to its projections as PEFT does: scaling * B(A(x)), A [r, in], B [out, r].
    `module` holds them under their names (weight sync keeps its parameters as a KeptModel's: they are read at each
    forward, so a sync's new values are used from the next call on)."""

    def __init__(
        self, shapes: Sequence[tuple[str, Sequence[int]]], scaling: float, dtype: torch.dtype, device: torch.device
    ) -> None:
        if (why := adapter_blocker(n for n, _ in shapes)) is not None:
            raise ValueError(f"the native decoder cannot run these LoRA adapters: {why}")
        self.module = adapter_module(shapes, dtype, device)
        self.scaling = scaling
        params = dict(self.module.named_parameters())
        self.by_layer: dict[int, dict[str, tuple[nn.Parameter, nn.Parameter]]] = {}
        for name in params:
            match = ADAPTED.match(name)
            assert match is not None
            if match.group(3) == "A":
                layer, proj = int(match.group(1)), match.group(2)
                b_name = name.replace(".lora_A.", ".lora_B.")
                self.by_layer.setdefault(layer, {})[proj] = (params[name], params[b_name])

    def delta(self, layer: int, projections: Sequence[tuple[str, int]], x: torch.Tensor) -> torch.Tensor | None:
        """x [..., in] -> [..., sum of outs]: each of `projections` (name, out features)' scaling * B(A(x)) side by
        side as the joined projection's output lies (zeros for one without an adapter); None: none has one."""
        found = self.by_layer.get(layer, {})
        if not any(name in found for name, _ in projections):
            return None
        parts = []
        for name, out in projections:
            if name in found:
                a, b = found[name]
                parts.append(F.linear(F.linear(x, a), b) * self.scaling)
            else:
                parts.append(x.new_zeros((*x.shape[:-1], out)))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


# ---- the HF modules the decoder reads ------------------------------------------------------------------------------
# Llama, Qwen2, Qwen3 and Mistral name them alike; a model `unsupported_reason` accepts has this tree.


class _Config(Protocol):
    model_type: str
    rms_norm_eps: float
    num_attention_heads: int
    hidden_size: int
    intermediate_size: int


class _Norm(Protocol):  # RMSNorm
    weight: torch.Tensor


class _Attention(Protocol):
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    q_norm: _Norm  # _QK_NORM_TYPES only
    k_norm: _Norm


class _MLP(Protocol):
    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear


class _Experts(Protocol):  # transformers 5's fused experts: [X, 2I, E] (gate rows, then up rows) and [X, E, I]
    gate_up_proj: torch.Tensor
    down_proj: torch.Tensor


class _SparseMLP(Protocol):  # Qwen2-MoE / Qwen3-MoE / Mixtral sparse block (rlrun.models.moe)
    gate: nn.Module  # the top-k router: weight [X, E], top_k, num_experts (norm_topk_prob on Qwen)
    experts: _Experts


class _Block(Protocol):
    self_attn: _Attention
    mlp: _MLP
    input_layernorm: _Norm
    post_attention_layernorm: _Norm


class _Body(Protocol):
    embed_tokens: nn.Embedding
    layers: Iterable[_Block]
    norm: _Norm
    rotary_emb: nn.Module  # (x, position_ids) -> (cos, sin)


class _CausalLM(Protocol):
    config: _Config
    model: _Body
    lm_head: nn.Linear


def _joined(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """One tensor over parts [r_i, *rest] (same dtype and rest) that lie back to back in one storage, sharing their
    memory: [sum r_i, *rest]; None when they do not lie so."""
    first = parts[0]
    for a, b in zip(parts, parts[1:]):
        if not (
            a.is_contiguous()
            and b.is_contiguous()
            and a.dtype == b.dtype
            and a.shape[1:] == b.shape[1:]
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.data_ptr() + a.nbytes == b.data_ptr()
        ):
            return None
    return first.detach().as_strided((sum(p.shape[0] for p in parts), *first.shape[1:]), first.stride())


def _lay_out_back_to_back(params: Sequence[torch.Tensor]) -> None:
    """Make `params` views into one new storage, back to back, keeping their values."""
    if _joined(params) is not None:
        return
    joined = torch.cat([p.detach() for p in params])
    start = 0
    for p in params:
        p.data = joined[start : start + p.shape[0]]
        start += p.shape[0]


def _projections(
    block: _Block,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """A decoder block's parameters that run joined: q/k/v weights, their biases (None without), gate/up weights
    (None in a MoE layer), their biases (None without); in fused_groups' order."""
    attention = [block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj]
    weights: list[torch.Tensor] = [m.weight for m in attention]
    biases: list[torch.Tensor] | None = None if attention[0].bias is None else [m.bias for m in attention]
    if _sparse(block) is not None:
        return weights, biases, None, None  # a MoE layer: its experts run in Decoder._experts
    mlp = [block.mlp.gate_proj, block.mlp.up_proj]
    return weights, biases, [m.weight for m in mlp], None if mlp[0].bias is None else [m.bias for m in mlp]


def _sparse(block: _Block) -> _SparseMLP | None:
    """The block's sparse MoE MLP (None: a dense SwiGLU)."""
    mlp = block.mlp
    return cast(_SparseMLP, mlp) if hasattr(mlp, "experts") and hasattr(mlp, "gate") else None


@dataclass
class _Layer:
    """One decoder block: the HF modules and, for one call, the joined projections over their parameters."""

    block: _Block
    qkv_weight: torch.Tensor  # [(H + 2K) D, E]
    qkv_bias: torch.Tensor | None  # [(H + 2K) D]
    gate_up: torch.Tensor | None  # [2 I, E]; None in a MoE layer
    gate_up_bias: torch.Tensor | None  # [2 I]


def grouped_mm_runs(weight: torch.Tensor) -> bool:
    """Whether torch's grouped matmul (F.grouped_mm) runs on `weight`'s device and dtype: CUDA wants bf16."""
    return hasattr(F, "grouped_mm") and weight.is_cuda and weight.dtype == torch.bfloat16


def expert_loop(
    flat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Routed experts' output [N, E] for tokens flat [N, E] sent to experts ids [N, k] with weights [N, k]
    (gate_up [X, 2I, E], down [X, E, I]): each expert with tokens on its own, as transformers' eager experts. Reads
    on the host which experts have tokens."""
    out = torch.zeros_like(flat)
    for expert in ids.unique().tolist():
        token, choice = (ids == expert).nonzero(as_tuple=True)
        gate, up = F.linear(flat[token], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert]) * weights[token, choice, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def grouped_experts(
    flat: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """expert_loop's result with no host sync and fixed shapes: the N k (token, expert) slots sorted by expert, each
    expert's run of slots through its projections by one grouped matmul (offsets on the device), the slots added
    back into their tokens. What a captured decode step runs (transformers' grouped_mm experts do the same)."""
    rows, k = ids.shape
    slots = ids.reshape(-1)
    order = slots.argsort(stable=True)  # [N k]: slots by expert
    token = order // k
    counts = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))  # not bincount: its size syncs
    offsets = counts.cumsum(0, dtype=torch.int32)  # each expert's end in the sorted slots
    gate, up = F.grouped_mm(flat[token], gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    y = F.grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)  # [N k, E]
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(flat).index_add_(0, token, y.to(flat.dtype))


class KVCache:
    """Per layer keys (interleaved features) and values [B, K, C, D]; `length` positions are filled. Rows can be
    dropped (`keep`)."""

    def __init__(
        self,
        layers: int,
        rows: int,
        kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        zeroed: bool = False,
    ) -> None:
        new = torch.zeros if zeroed else torch.empty
        self.keys = [new(rows, kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros_like(k) if zeroed else torch.empty_like(k) for k in self.keys]
        self.length = 0

    def keep(self, rows: torch.Tensor) -> None:
        """Only `rows` (indices into the current rows) stay, in that order."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]


class Decoder:
    """Forward passes of one HF Llama-family causal LM (`unsupported_reason` is None for its config) over a KVCache."""

    def __init__(self, model: nn.Module) -> None:
        hf = cast(_CausalLM, model)  # the module tree of the models unsupported_reason accepts
        c = hf.config
        self.model = hf
        self.body = hf.model
        self.eps = float(c.rms_norm_eps)
        self.heads = int(c.num_attention_heads)
        self.kv_heads = int(getattr(c, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // self.heads)
        self.intermediate = int(c.intermediate_size)
        self.scale = self.head_dim**-0.5
        self.qk_norm = c.model_type in _QK_NORM_TYPES
        self.blocks = list(self.body.layers)
        for block in self.blocks:
            for params in _projections(block):
                if params is not None:
                    _lay_out_back_to_back(params)
        self.layers: list[_Layer] = []  # inside weights(): the joined projections of each block
        # record_routing(): each MoE layer's top-k expert ids [B, S, k] of the forward running now, in layer order
        self.routes: list[torch.Tensor] | None = None
        # MoE layers: run every expert in one grouped matmul over the tokens sorted by expert (no host sync, so a
        # decode step can be captured), or loop over the experts that have tokens; None: grouped where torch's
        # kernel runs on the device (CUDA, bf16 experts), the loop elsewhere (faster on CPU)
        self.grouped_experts: bool | None = None
        self.adapters: Adapters | None = None  # a LoRA policy's adapters, run beside the base projections

    @property
    def dtype(self) -> torch.dtype:
        return self.body.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.body.embed_tokens.weight.device

    @contextmanager
    def weights(self) -> Iterator[int]:
        """The forwards (prefill, decode) run inside: the projections joined over the HF parameters as they are now
        (weight sync may have written or re-pointed them since the last call), released on exit. Yields how many
        groups had to be copied (their parameters were not back to back)."""
        copied = 0
        with torch.no_grad():
            for block in self.blocks:
                joined: list[torch.Tensor | None] = []
                for params in _projections(block):
                    view = None if params is None else _joined(params)
                    if params is not None and view is None:
                        view = torch.cat([p.detach() for p in params])
                        copied += 1
                    joined.append(view)
                self.layers.append(_Layer(block, *joined))  # type: ignore[arg-type]
        try:
            yield copied
        finally:
            self.layers = []

    def _adapted(
        self, y: torch.Tensor, layer: int, projections: Sequence[tuple[str, int]], x: torch.Tensor
    ) -> torch.Tensor:
        """A projection's output y [..., out] of input x [..., in], with its adapters' product added (if any)."""
        delta = None if self.adapters is None else self.adapters.delta(layer, projections, x)
        return y if delta is None else y + delta

    def new_cache(self, rows: int, capacity: int, zeroed: bool = False) -> KVCache:
        """zeroed: positions not written yet hold zeros, not whatever the memory held (a NaN there would survive the
        mask: NaN * 0); needed by decode(slot=), which reads the whole capacity."""
        return KVCache(len(self.blocks), rows, self.kv_heads, capacity, self.head_dim, self.dtype, self.device, zeroed)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, valid: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Left-padded prompts ids [B, W] with valid [B, W] (False on padding) into an empty cache; the
        last-position logits [B, V] (fp32). Padding positions attend only to themselves (never read by real ones)."""
        width = ids.shape[1]
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
        eye = torch.eye(width, dtype=torch.bool, device=ids.device)
        mask = ((causal & valid[:, None, :]) | eye)[:, None]  # [B, 1, W, W]

        def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            # enable_gqa with a boolean mask runs a fused kernel on torch 2.11 + H200 (one Qwen2.5-0.5B layer at
            # [16, 2048]: 1.32 ms, 0.18 GiB peak; K/V repeated per head instead: 1.46 ms, 0.29 GiB; the [B, H, W, W]
            # scores a math kernel would hold: 3.5 GiB), so K/V stay unrepeated (bench/gpu, prefill_memory).
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=self.kv_heads != self.heads
            )
            return out.transpose(1, 2).reshape(ids.shape[0], width, -1)

        hidden = self._blocks(self.body.embed_tokens(ids), positions, cache, attend)
        return self._logits(hidden[:, -1])

    @torch.no_grad()
    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        cache: KVCache,
        slot: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One new token per row: tokens [B], positions [B], valid [B, T] (the cached positions and this one);
        appends to the cache, returns logits [B, V] (fp32).
        slot ([1] long): static shapes instead, for a CUDA graph: this step's keys/values go to cache position
        `slot` (read on the device, not the host), valid is [B, T] for a fixed span T <= the capacity that covers
        slot (False on positions not written yet, which a zeroed cache holds as zeros) and attention runs over
        those T positions; cache.length is left alone."""
        rows, T = valid.shape
        K = self.kv_heads
        # [B K, 1, T] fp32: 0 where a row may attend, -inf on its padding; shared by every layer of this step.
        bias = torch.zeros(rows, T, dtype=torch.float32, device=valid.device).masked_fill_(~valid, float("-inf"))
        bias = bias[:, None, None].expand(rows, K, 1, T).reshape(rows * K, 1, T)

        def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            # [:, :, :T]: with `slot` the layer hands over the whole capacity; rows and heads still merge as a view
            return decode_attention(
                q.reshape(rows * K, -1, self.head_dim),
                keys[:, :, :T].reshape(rows * K, T, -1),
                values[:, :, :T].reshape(rows * K, T, -1),
                bias,
                self.scale,
            ).view(rows, 1, -1)

        hidden = self._blocks(self.body.embed_tokens(tokens[:, None]), positions[:, None], cache, attend, slot)
        return self._logits(hidden[:, 0])

    def take_routes(self) -> torch.Tensor:
        """[B, S, layers, k] uint8: the expert ids every MoE layer chose for the last forward's tokens (recording
        goes on for the next forward)."""
        assert self.routes is not None, "Decoder.routes is None: set it to [] to record routing"
        ids = torch.stack(self.routes, dim=2).to(torch.uint8)
        self.routes = []
        return ids

    def experts_capturable(self) -> bool:
        """Whether every MoE layer runs without a host sync (grouped_experts), so a decode step can be captured; True
        for a dense model."""
        sparse = [mlp for block in self.blocks if (mlp := _sparse(block)) is not None]
        return all(self._grouped(mlp.experts.gate_up_proj) for mlp in sparse)

    def _grouped(self, weight: torch.Tensor) -> bool:
        return grouped_mm_runs(weight) if self.grouped_experts is None else self.grouped_experts

    def _experts(self, mlp: _SparseMLP, h: torch.Tensor) -> torch.Tensor:
        """A sparse MoE MLP on h [B, S, E] -> [B, S, E], as transformers' Qwen2-MoE / Qwen3-MoE / Mixtral blocks
        compute it (router softmax in fp32, top-k, renormalised where the model does, each expert on its tokens;
        Qwen2-MoE's sigmoid-gated shared expert added). Records the chosen ids when self.routes is a list."""
        rows, new, width = h.shape
        flat = h.reshape(-1, width)
        router = mlp.gate
        logits = F.linear(flat, router.weight)  # type: ignore[arg-type]  # [N, X]
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = probs.topk(int(router.top_k), dim=-1)  # type: ignore[arg-type]
        if renormalises(router):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routes is not None:
            self.routes.append(ids.view(rows, new, -1))
        experts = mlp.experts
        run = grouped_experts if self._grouped(experts.gate_up_proj) else expert_loop
        out = run(flat, ids, weights, experts.gate_up_proj, experts.down_proj)
        shared = getattr(mlp, "shared_expert", None)
        if shared is not None:  # Qwen2-MoE
            s = shared.down_proj(F.silu(shared.gate_proj(flat)) * shared.up_proj(flat))
            out = out + torch.sigmoid(mlp.shared_expert_gate(flat)) * s  # type: ignore[attr-defined]
        return out.view(rows, new, width)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, E] -> logits [B, V] in fp32 (as HF's generate upcasts them)."""
        return self.model.lm_head(_rms_norm(hidden, self.body.norm.weight, self.eps)).float()

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[B, S, 1, D/2] complex: cos + i sin of each position, from the model's own rotary module (its inv_freq,
        scaling and rope type; HF's cos/sin repeat their first half, so the first half is all there is)."""
        cos, sin = self.body.rotary_emb(x, positions)
        half = self.head_dim // 2
        return torch.complex(cos[..., :half].float(), sin[..., :half].float())[:, :, None]

    def _blocks(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, attend, slot: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, S, E] at positions [B, S] (S new positions after cache.length; with `slot`, S = 1 at cache
        position slot, and attend gets the whole capacity to pick its span from: see decode); `attend(q [B, S, H, D],
        keys [B, K, T, D], values [B, K, T, D]) -> [B, S, H D]`."""
        if not self.layers:
            raise RuntimeError("Decoder: a forward runs inside `with decoder.weights():` (it joins the projections)")
        rows, new = x.shape[:2]
        H, K, D = self.heads, self.kv_heads, self.head_dim
        rotation = self._rotary(x, positions)
        start, end = cache.length, cache.length + new
        for i, layer in enumerate(self.layers):
            block = layer.block
            h = _rms_norm(x, block.input_layernorm.weight, self.eps)
            qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias)
            qkv = self._adapted(
                qkv, i, (("self_attn.q_proj", H * D), ("self_attn.k_proj", K * D), ("self_attn.v_proj", K * D)), h
            )
            qk = qkv[..., : (H + K) * D].view(rows, new, H + K, D)
            if self.qk_norm:
                attention = block.self_attn
                qk = torch.cat(
                    [
                        _rms_norm(qk[:, :, :H], attention.q_norm.weight, self.eps),
                        _rms_norm(qk[:, :, H:], attention.k_norm.weight, self.eps),
                    ],
                    dim=2,
                )
            # [..., D] -> [..., D/2, 2]: feature j beside its rotate-half partner j + D/2 (one copy, in fp32)
            pairs = qk.unflatten(-1, (2, D // 2)).transpose(-1, -2)
            pairs = pairs.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            qk = torch.view_as_real(torch.view_as_complex(pairs) * rotation).flatten(-2).to(x.dtype)
            new_keys = qk[:, :, H:].transpose(1, 2)
            new_values = qkv[..., (H + K) * D :].view(rows, new, K, D).transpose(1, 2)
            if slot is None:
                cache.keys[i][:, :, start:end] = new_keys
                cache.values[i][:, :, start:end] = new_values
                keys, values = cache.keys[i][:, :, :end], cache.values[i][:, :, :end]
            else:
                keys = cache.keys[i].index_copy_(2, slot, new_keys)
                values = cache.values[i].index_copy_(2, slot, new_values)
            out = attend(qk[:, :, :H], keys, values)
            o_proj = block.self_attn.o_proj
            x = x + self._adapted(
                F.linear(out, o_proj.weight, o_proj.bias), i, (("self_attn.o_proj", o_proj.weight.shape[0]),), out
            )
            h = _rms_norm(x, block.post_attention_layernorm.weight, self.eps)
            sparse = _sparse(block)
            if sparse is not None:
                x = x + self._experts(sparse, h)
                continue
            assert layer.gate_up is not None  # a dense layer's
            gate_up = F.linear(h, layer.gate_up, layer.gate_up_bias)
            gate_up = self._adapted(
                gate_up, i, (("mlp.gate_proj", self.intermediate), ("mlp.up_proj", self.intermediate)), h
            )
            gate, up = gate_up.split([self.intermediate, self.intermediate], dim=-1)
            down = block.mlp.down_proj
            act = F.silu(gate) * up
            x = x + self._adapted(
                F.linear(act, down.weight, down.bias), i, (("mlp.down_proj", down.weight.shape[0]),), act
            )
        if slot is None:
            cache.length = end
        return x
