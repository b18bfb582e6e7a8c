"""Ulysses sequence parallelism: the `sp` ranks of a sequence-parallel group each hold a contiguous 1/sp of a packed
micro-batch's token columns; around attention an all-to-all turns [heads, tokens/sp] into [heads/sp, all tokens], so
every rank attends over whole sequences for its share of the heads, and a second all-to-all turns it back.

The attention hook is a function registered with transformers' AttentionInterface under `ULYSSES` and selected by
`enable(model)`: a model forward that receives the keyword `ulysses=UlyssesCall(...)` (the model hands extra keywords
down to its attention layers, gradient checkpointing's recompute included) runs sequence-parallel; without it the
registered function is the model's own sdpa, so the same model still serves unsplit forwards (HF generate, evaluation).
Nothing global is patched, so other models on the rank are untouched.

Design points, after verl's Ulysses (verl/utils/ulysses.py, verl/models/transformers/monkey_patch.py) and
DeepSpeed-Ulysses:
- Every rank of a group holds the whole micro-batch (rlrun's roles all hold the rollout batch): no data exchange, each
  takes its columns; positions stay global, so RoPE is exact.
- GQA: when sp does not divide the KV heads they are repeated sp / gcd(KV, sp) times first (verl repeats max(sp // KV,
  1), which needs KV | sp or sp | KV; this covers e.g. KV 3 at sp 2). The query heads must divide by sp.
- Attention over the gathered rows follows the packed sequences, since transformers' own mask builder sees only the
  local columns: rows up to DENSE_MASK_COLUMNS wide take one block-diagonal causal mask built once per forward from
  the full positions (one kernel call for many short sequences); wider rows run each packed sequence as its own
  causal attention (no [S, S] mask: memory grows with S, not S squared, which is what lets long responses fit; a
  sliding-window model builds a mask for a sequence longer than its window only).
- Per-token outputs (log-probs, entropy, values) are computed on the local columns and gathered (`gather_columns`); its
  backward hands each rank its own slice times sp, because every rank of the group computes the same loss on the
  gathered tensor while the data-parallel gradient reduction averages over all dp x sp ranks (verl's grad_scaler).

Only sdpa runs inside (on CPU and GPU; flash-attention's varlen inner path is not wired yet: --flash_attn runs sdpa
here, and a start-up line says so).

Without sequence parallelism the same function attends packed rows without flash-attention (`UlyssesCall(None,
positions)`, rlrun.roles.forward): the whole micro-batch is one row of its real tokens and each sequence is its own
causal sdpa call, so attention costs sum(n_i^2) as flash-attention's varlen kernel does, not (sum n_i)^2 under a
block-diagonal mask, and no [S, S] mask is built.
Shapes: b rows, h query heads, kv key/value heads, s local columns, S = sp * s all columns, d head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlrun.launch.groups import SequenceParallel

ULYSSES = "rlrun_ulysses"  # the attention implementation's registered name
INNER = "sdpa"  # what runs on the full sequence (and unsplit forwards)
# Widest gathered row attended with one dense mask ([S, S] bool plus sdpa's additive copy: 48 MiB per row in bf16
# at 4096); wider rows attend sequence by sequence (rlrun.plan.memory.ulysses_bytes counts the same).
DENSE_MASK_COLUMNS = 4096


@dataclass
class UlyssesCall:
    """One sequence-parallel forward: the group and the full packed positions [n, S] (S a multiple of sp), from which
    each rank's columns and the full attention mask come. Passed to the model as the keyword `ulysses`. sp None: no
    split, the rank's own packed rows attended sequence by sequence (module docstring)."""

    sp: SequenceParallel | None
    position_ids: Tensor
    _masks: dict[int | None, Tensor] = field(default_factory=dict, repr=False)
    _segments: list[list[tuple[int, int]]] | None = field(default=None, repr=False)

    @property
    def split(self) -> bool:
        """The columns are split over the ranks of a group (else this rank holds the whole rows)."""
        return self.sp is not None and self.sp.size > 1

    @property
    def columns(self) -> slice:
        if self.sp is None:
            return slice(0, self.position_ids.shape[-1])
        width = self.position_ids.shape[-1] // self.sp.size
        return slice(self.sp.rank * width, (self.sp.rank + 1) * width)

    def mask(self, sliding_window: int | None) -> Tensor:
        """[n, 1, S, S] bool: token i sees token j of the same packed sequence at j <= i (and within the sliding
        window), the mask transformers builds from packed positions on a whole row. Cached for every layer."""
        if sliding_window not in self._masks:
            pos = self.position_ids
            seq = (pos == 0).cumsum(-1)  # a sequence starts where its positions restart at 0
            same = seq.unsqueeze(-1) == seq.unsqueeze(-2)
            causal = torch.ones(pos.shape[-1], pos.shape[-1], dtype=torch.bool, device=pos.device).tril()
            allowed = same & causal
            if sliding_window is not None:
                allowed &= pos.unsqueeze(-1) - pos.unsqueeze(-2) < sliding_window
            self._masks[sliding_window] = allowed.unsqueeze(1)
        return self._masks[sliding_window]

    @property
    def dense(self) -> bool:
        """Attend the gathered rows with one mask (`mask`), not sequence by sequence (`segments`)."""
        return self.position_ids.shape[-1] <= DENSE_MASK_COLUMNS

    def segments(self) -> list[list[tuple[int, int]]]:
        """Per row, the [start, end) columns of each packed sequence (the tail padding one more): where the positions
        restart at 0. Read once per forward (one device sync), for every layer."""
        if self._segments is None:
            out = []
            for row in self.position_ids.tolist():
                starts = [i for i, p in enumerate(row) if p == 0] or [0]
                out.append(list(zip(starts, starts[1:] + [len(row)])))
            self._segments = out
        return self._segments


# ---- the collectives, with their gradients -------------------------------------------------------------------------


def _tokens_to_heads(x: Tensor, sp: SequenceParallel) -> Tensor:
    """[b, h, s, d] (all heads of this rank's columns) -> [b, h/sp, S, d] (this rank's heads of every column)."""
    b, h, s, d = x.shape
    send = x.reshape(b, sp.size, h // sp.size, s, d).transpose(0, 1).contiguous()  # block j: rank j's heads
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send, group=sp.group)  # got[j]: rank j's columns of this rank's heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp.size, sp.size * s, d)


def _heads_to_tokens(x: Tensor, sp: SequenceParallel) -> Tensor:
    """[b, h/sp, S, d] -> [b, h, s, d]: the inverse of _tokens_to_heads."""
    b, hl, full, d = x.shape
    s = full // sp.size
    send = x.reshape(b, hl, sp.size, s, d).permute(2, 0, 1, 3, 4).contiguous()  # block j: rank j's columns
    got = torch.empty_like(send)
    dist.all_to_all_single(got, send, group=sp.group)  # got[j]: this rank's columns of rank j's heads
    return got.transpose(0, 1).reshape(b, sp.size * hl, s, d)


class _TokensToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, sp: SequenceParallel) -> Tensor:
        ctx.sp = sp
        return _tokens_to_heads(x, sp)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _heads_to_tokens(grad.contiguous(), ctx.sp), None


class _HeadsToTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, sp: SequenceParallel) -> Tensor:
        ctx.sp = sp
        return _heads_to_tokens(x, sp)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _tokens_to_heads(grad.contiguous(), ctx.sp), None


class _GatherColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, sp: SequenceParallel) -> Tensor:
        ctx.sp = sp
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        sp = ctx.sp
        width = grad.shape[1] // sp.size
        # x sp: each rank of the group computes the same loss from the gathered tensor, and the gradient reduction
        # averages over the group's ranks too (module docstring)
        return grad[:, sp.rank * width : (sp.rank + 1) * width] * sp.size, None


def gather_columns(x: Tensor, sp: SequenceParallel) -> Tensor:
    """[n, S/sp, ...] of every rank of the group -> [n, S, ...] (differentiable)."""
    return _GatherColumns.apply(x, sp)


# ---- the attention function ----------------------------------------------------------------------------------------


def kv_repeats(kv_heads: int, sp: int) -> int:
    """How often each key/value head is repeated so that sp divides them: sp / gcd(kv_heads, sp) (1 when it does)."""
    return sp // math.gcd(kv_heads, sp)


@dataclass
class _Shim:
    """What sdpa reads of the attention module, for the rank's share of the heads."""

    num_key_value_groups: int
    is_causal: bool
    training: bool
    layer_idx: int | None
    config: Any


def _attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: query [b, h, s, d], key/value [b, kv, s, d] -> ([b, s, h, d],
    None). With no `ulysses` keyword, the model's own sdpa on what it was given."""

    call: UlyssesCall | None = kwargs.pop("ulysses", None)
    if call is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    kwargs.pop("position_ids", None)  # the call's positions carry the packed sequences' structure
    if not call.split:  # one rank's packed rows: each sequence its own causal attention
        return _by_sequence(module, query, key, value, call, sliding_window, dropout, scaling, kwargs), None
    sp = call.sp
    assert sp is not None  # a split call's
    heads, kv = query.shape[1], key.shape[1]
    if heads % sp.size:
        raise ValueError(f"{heads} attention heads do not split over sequence-parallel size {sp.size}")
    repeat = kv_repeats(kv, sp.size)
    if repeat > 1:
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q = _TokensToHeads.apply(query.contiguous(), sp)
    k = _TokensToHeads.apply(key.contiguous(), sp)
    v = _TokensToHeads.apply(value.contiguous(), sp)
    shim = _Shim(
        heads // (kv * repeat),
        getattr(module, "is_causal", True),
        module.training,
        getattr(module, "layer_idx", None),
        getattr(module, "config", None),
    )
    if call.dense:
        out, _ = sdpa_attention_forward(
            shim,  # type: ignore[arg-type]  # duck-typed: the attributes sdpa reads
            q,
            k,
            v,
            call.mask(sliding_window),
            dropout=dropout,
            scaling=scaling,
            is_causal=False,
            **kwargs,
        )
    else:
        out = _by_sequence(shim, q, k, v, call, sliding_window, dropout, scaling, kwargs)
    back = _HeadsToTokens.apply(out.transpose(1, 2).contiguous(), sp)  # [b, h, s, d]
    return back.transpose(1, 2).contiguous(), None


def _by_sequence(
    shim: _Shim | nn.Module,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    call: UlyssesCall,
    sliding_window: int | None,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> Tensor:
    """Each packed sequence of the gathered rows as its own causal attention: q [b, h/sp, S, d], k/v [b, kv', S, d]
    -> [b, S, h/sp, d]. `shim`: the attention module, or what sdpa reads of it for this rank's heads."""
    rows = []
    for r, segments in enumerate(call.segments()):
        parts = []
        for start, end in segments:
            n = end - start
            mask = None
            if sliding_window is not None and n > sliding_window:
                i = torch.arange(n, device=q.device)
                mask = ((i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < sliding_window))[None, None]
            part, _ = sdpa_attention_forward(
                shim,  # type: ignore[arg-type]
                q[r : r + 1, :, start:end],
                k[r : r + 1, :, start:end],
                v[r : r + 1, :, start:end],
                mask,
                dropout=dropout,
                scaling=scaling,
                is_causal=mask is None,
                **kwargs,
            )
            parts.append(part)  # [1, n, h/sp, d]
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0)


def register() -> None:
    """Make `ULYSSES` a valid attn_implementation (idempotent). Its masks are sdpa's, so that a padded forward of an
    enabled model still masks its padding (transformers builds no mask at all for a name it has no mask function
    for); the calls with `ulysses` pass a placeholder mask instead (`no_mask`), so that none is built for them."""
    AttentionInterface.register(ULYSSES, _attention)
    AttentionMaskInterface.register(ULYSSES, sdpa_mask)


def no_mask(device: torch.device) -> Tensor:
    """The attention_mask a forward with `ulysses` passes: a 4-D mask is taken as prepared, so transformers builds
    none ([S, S] per row otherwise); _attention ignores it, since the call's positions say what attends to what."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)


def hf_model(model: nn.Module) -> PreTrainedModel:
    """The transformers model inside rlrun's wrappers (a scalar-head model's `hf`, DeepSpeed's `module`, PEFT's)."""
    if isinstance(model, PreTrainedModel):
        return model
    for attr in ("hf", "module", "base_model", "model"):
        inner = getattr(model, attr, None)
        if isinstance(inner, nn.Module) and inner is not model:
            return hf_model(inner)
    raise TypeError(f"{type(model).__name__} holds no transformers model to run sequence-parallel")


def enable(model: nn.Module) -> None:
    """Select the Ulysses attention on `model` (its text part: a vision tower keeps its own)."""
    register()
    hf = hf_model(model)
    if hf.config.get_text_config() is not hf.config:
        hf.set_attn_implementation({"text_config": ULYSSES})
    else:
        hf.set_attn_implementation(ULYSSES)


def packs_by_sequence(model: nn.Module) -> bool:
    """Whether `model`'s packed rows should attend sequence by sequence (one row, no mask): a text model on sdpa
    that Ulysses' attention runs. flash-attention keeps its own varlen kernel, eager its exact op order, and a
    vision-language model its own packed inputs."""
    hf = hf_model(model)
    config = hf.config
    return (
        config.get_text_config() is config
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and unsupported_reason(config, 1) is None
    )


def unsupported_reason(config: Any, sp: int) -> str | None:
    """Why a model of this config cannot run at sequence-parallel size `sp` (None: it can)."""
    text = config.get_text_config()
    heads = getattr(text, "num_attention_heads", None)
    if heads is None:
        return f"its config names no attention heads ({type(text).__name__})"
    if heads % sp:
        return f"its {heads} attention heads do not divide by sequence-parallel size {sp}"
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(text, name, None) not in (None, 0):
            return f"it soft-caps its attention ({name}), which rlrun's Ulysses attention does not"
    return None
