"""A lean KV-cache forward for Llama-family causal LMs (Llama, Qwen2, Qwen3, Mistral), on the HF model's own weights.

Why: for the model sizes RL runs on a CPU, and for every model at small batch, transformers' `generate` spends
most of a decode step outside the matmuls (cache objects, mask builders, logits processors, module hooks, and
dozens of tiny tensor ops per layer). This module runs the same arithmetic as the HF modules with as few ops as
it can:
- the query/key/value and gate/up projections are fused into one matmul each (copies of the HF weights, re-read
  by `refresh()` after weight sync wrote new ones into the HF modules);
- inside each head the query/key features are stored pair-interleaved (feature j next to feature j + D/2), so
  HF's rotate-half rotary embedding becomes one complex multiply; queries and keys are permuted alike, so every
  attention score is the same dot product (summed in another order);
- one decode step's attention is a baddbmm + softmax + bmm over the cache (scores and softmax in fp32, as the
  fused attention kernels compute them), with the padding mask built once per step for all layers;
- a decode step can also run with static shapes (`decode(..., slot=)`: the cache written at a position given as a
  tensor, attention over the whole capacity under the mask), the step a CUDA graph captures (rlrun.engines.native).
The HF model stays the source of truth: nothing here is trained or saved.

Shapes: B rows, W prompt width (left-padded), S new positions, T cached positions (after the new ones), C cache
capacity, H query heads, K key/value heads, G = H / K, D head dim, E hidden size, I intermediate size, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rlrun.models.architecture import is_vision_language

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
_QK_NORM_TYPES = ("qwen3",)


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


def _interleave(head_dim: int) -> torch.Tensor:
    """Feature order inside a head that puts HF's rotary partners j and j + D/2 side by side: [0, D/2, 1, D/2+1, ...]."""
    half = head_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).reshape(-1)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One decode step's attention per (row, key/value head) N: q [N, G, D], keys and values [N, T, D] in the model's
    dtype, bias [N, 1, T] fp32 (0 or -inf) -> [N, G, D] in the model's dtype.

    Scores and softmax in fp32 whatever the model's dtype, as the fused kernels behind the actor's forward (SDPA,
    flash-attn) keep them: a bf16 score keeps 8 significant bits (steps of 1/16 at magnitudes 8-16), which would
    move each attention probability by up to ~3%, and the log-probs the engine reports with them. (HF's eager
    attention rounds the scores to bf16 as the matmul's output; SDPA and flash-attn do not.) The probabilities are
    then cast to the model's dtype for the value product, summed in fp32 by the matmul, as flash-attn does."""
    scores = torch.baddbmm(bias, q.float(), keys.float().transpose(1, 2), alpha=scale)
    return torch.bmm(torch.softmax(scores, dim=-1).to(q.dtype), values)


@dataclass
class _Layer:
    """One decoder block: the HF modules (weight sync may re-point their parameters' storage, never the objects)
    and this decoder's fused, query/key-interleaved copies of their projections."""

    block: nn.Module
    qkv_weight: torch.Tensor  # [(H + 2K) D, E]
    qkv_bias: torch.Tensor | None  # [(H + 2K) D]
    gate_up: torch.Tensor  # [2 I, E]
    gate_up_bias: torch.Tensor | None  # [2 I]
    q_norm: torch.Tensor | None  # [D] interleaved (Qwen3)
    k_norm: torch.Tensor | None  # [D]


class KVCache:
    """Per layer keys (interleaved features) and values [B, K, C, D]; `length` positions are filled. Rows can be
    dropped (`keep`)."""

    def __init__(self, layers: int, rows: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, zeroed: bool = False) -> None:
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
        c = model.config
        self.model = model
        self.body = model.model
        self.eps = float(c.rms_norm_eps)
        self.heads = int(c.num_attention_heads)
        self.kv_heads = int(getattr(c, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // self.heads)
        self.intermediate = int(c.intermediate_size)
        self.scale = self.head_dim ** -0.5
        self.qk_norm = c.model_type in _QK_NORM_TYPES
        self._order = self._qkv_order().to(self.body.embed_tokens.weight.device)
        self.layers = [self._fuse(block) for block in self.body.layers]

    @property
    def dtype(self) -> torch.dtype:
        return self.body.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.body.embed_tokens.weight.device

    def _qkv_order(self) -> torch.Tensor:
        """Rows of cat(q, k, v) in this decoder's order: each query and key head interleaved, values as they are."""
        D = self.head_dim
        inner = _interleave(D)
        heads = torch.arange(self.heads + self.kv_heads)[:, None] * D + inner[None, :]
        values = torch.arange((self.heads + self.kv_heads) * D, (self.heads + 2 * self.kv_heads) * D)
        return torch.cat([heads.reshape(-1), values])

    def _fuse(self, block: nn.Module) -> _Layer:
        a, m = block.self_attn, block.mlp
        with torch.no_grad():
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])[self._order]
            bias = None
            if a.q_proj.bias is not None:
                bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])[self._order]
            gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight])
            gate_up_bias = torch.cat([m.gate_proj.bias, m.up_proj.bias]) if m.gate_proj.bias is not None else None
            inner = self._order[:self.head_dim]
            q_norm = a.q_norm.weight[inner].clone() if self.qk_norm else None
            k_norm = a.k_norm.weight[inner].clone() if self.qk_norm else None
        return _Layer(block, qkv, bias, gate_up, gate_up_bias, q_norm, k_norm)

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-read the fused projections from the HF modules (after weight sync wrote new weights into them)."""
        for i, layer in enumerate(self.layers):
            fresh = self._fuse(layer.block)
            for name in ("qkv_weight", "qkv_bias", "gate_up", "gate_up_bias", "q_norm", "k_norm"):
                mine = getattr(layer, name)
                if mine is not None:
                    mine.copy_(getattr(fresh, name))

    def new_cache(self, rows: int, capacity: int, zeroed: bool = False) -> KVCache:
        """zeroed: positions not written yet hold zeros, not whatever the memory held (a NaN there would survive the
        mask: NaN * 0); needed by decode(slot=), which reads the whole capacity."""
        return KVCache(len(self.layers), rows, self.kv_heads, capacity, self.head_dim, self.dtype, self.device, zeroed)

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
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                                 enable_gqa=self.kv_heads != self.heads)
            return out.transpose(1, 2).reshape(ids.shape[0], width, -1)

        hidden = self._blocks(self.body.embed_tokens(ids), positions, cache, attend)
        return self._logits(hidden[:, -1])

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, cache: KVCache,
               slot: torch.Tensor | None = None) -> torch.Tensor:
        """One new token per row: tokens [B], positions [B], valid [B, T] (the cached positions and this one);
        appends to the cache, returns logits [B, V] (fp32).
        slot ([1] long): static shapes instead, for a CUDA graph: this step's keys/values go to cache position
        `slot` (read on the device, not the host), valid is [B, C] (the whole capacity; False on positions not
        written yet, which a zeroed cache holds as zeros) and attention runs over all C positions; cache.length
        is left alone."""
        rows, T = valid.shape
        K = self.kv_heads
        # [B K, 1, T] fp32: 0 where a row may attend, -inf on its padding; shared by every layer of this step.
        bias = torch.zeros(rows, T, dtype=torch.float32, device=valid.device).masked_fill_(~valid, float("-inf"))
        bias = bias[:, None, None].expand(rows, K, 1, T).reshape(rows * K, 1, T)

        def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
            return decode_attention(q.reshape(rows * K, -1, self.head_dim), keys.reshape(rows * K, T, -1),
                                    values.reshape(rows * K, T, -1), bias, self.scale).view(rows, 1, -1)

        hidden = self._blocks(self.body.embed_tokens(tokens[:, None]), positions[:, None], cache, attend, slot)
        return self._logits(hidden[:, 0])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, E] -> logits [B, V] in fp32 (as HF's generate upcasts them)."""
        return self.model.lm_head(_rms_norm(hidden, self.body.norm.weight, self.eps)).float()

    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[B, S, 1, D/2] complex: cos + i sin of each position, from the model's own rotary module (its inv_freq,
        scaling and rope type; HF's cos/sin repeat their first half, so the first half is all there is)."""
        cos, sin = self.body.rotary_emb(x, positions)
        half = self.head_dim // 2
        return torch.complex(cos[..., :half].float(), sin[..., :half].float())[:, :, None]

    def _blocks(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, attend,
                slot: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, E] at positions [B, S] (S new positions after cache.length; with `slot`, S = 1 at cache
        position slot, attending over the whole capacity: see decode); `attend(q [B, S, H, D], keys [B, K, T, D],
        values [B, K, T, D]) -> [B, S, H D]`."""
        rows, new = x.shape[:2]
        H, K, D = self.heads, self.kv_heads, self.head_dim
        rotation = self._rotary(x, positions)
        start, end = cache.length, cache.length + new
        for i, layer in enumerate(self.layers):
            block = layer.block
            h = _rms_norm(x, block.input_layernorm.weight, self.eps)
            qkv = F.linear(h, layer.qkv_weight, layer.qkv_bias)
            qk = qkv[..., :(H + K) * D].view(rows, new, H + K, D)
            if layer.q_norm is not None:
                qk = torch.cat([_rms_norm(qk[:, :, :H], layer.q_norm, self.eps),
                                _rms_norm(qk[:, :, H:], layer.k_norm, self.eps)], dim=2)
            qk = qk.float() if qk.dtype != torch.float32 else qk
            qk = torch.view_as_real(torch.view_as_complex(qk.unflatten(-1, (D // 2, 2))) * rotation).flatten(-2)
            qk = qk.to(x.dtype)
            new_keys = qk[:, :, H:].transpose(1, 2)
            new_values = qkv[..., (H + K) * D:].view(rows, new, K, D).transpose(1, 2)
            if slot is None:
                cache.keys[i][:, :, start:end] = new_keys
                cache.values[i][:, :, start:end] = new_values
                keys, values = cache.keys[i][:, :, :end], cache.values[i][:, :, :end]
            else:
                keys = cache.keys[i].index_copy_(2, slot, new_keys)
                values = cache.values[i].index_copy_(2, slot, new_values)
            out = attend(qk[:, :, :H], keys, values)
            o_proj = block.self_attn.o_proj
            x = x + F.linear(out, o_proj.weight, o_proj.bias)
            h = _rms_norm(x, block.post_attention_layernorm.weight, self.eps)
            gate, up = F.linear(h, layer.gate_up, layer.gate_up_bias).split([self.intermediate, self.intermediate], dim=-1)
            down = block.mlp.down_proj
            x = x + F.linear(F.silu(gate) * up, down.weight, down.bias)
        if slot is None:
            cache.length = end
        return x
