"""Forward passes shared by the roles: response log-probs, per-token values and last-token scores,
on padded rows or (with --packing_samples) on packed rows (rlrun.data.packing).

Every forward passes use_cache=False: without it HF builds a KV cache nobody reads, and a cache
also turns off transformers' packed-sequence detection from position ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from rlrun.algo.losses import entropy_from_logits, log_probs_from_logits
from rlrun.algo.vocab_chunks import chunked_log_probs
from rlrun.data.batching import RowLengths, TokenBudget, pad_responses, restore_order, trim_padding
from rlrun.data.packing import PackedBatch, assign_rows, pack_batch
from rlrun.data.rollout import RolloutBatch
from rlrun.data.vision_batch import RowVision
from rlrun.launch.groups import SequenceParallel
from rlrun.models.loading import position_ids_from
from rlrun.models.moe import RoutingRun, in_forward_order
from rlrun.strategies.ulysses import ULYSSES, UlyssesCall, gather_columns, no_mask
from rlrun.vision.inputs import packed_inputs, padded_inputs

# Attention kernels that take packed sequences as ONE row and run varlen attention on it (cost sum(n_i^2)):
# flash-attention's, and rlrun's sequence-by-sequence sdpa (ULYSSES without a split: strategies/ulysses.py), which
# needs the call below. Every other kernel gets a dense block-diagonal mask per row, so rows stay as wide as the
# padded batch (cost per row unchanged, fewer rows).
_VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", ULYSSES)

# Positions per chunk of the vocab projection for log-probs/entropy (--logits_chunk_size): the logits then take at most
# LOGITS_CHUNK x V x 4 bytes at a time instead of response x V. <= 0: the whole micro-batch's logits at once.
LOGITS_CHUNK = 1024

# Config attributes with which a model's forward transforms the head's logits before returning them (Gemma-2/3
# soft-capping, Cohere's logit_scale, Granite's logits_scaling, and the like): the chunked path would skip the
# transform, so such models keep the full-logits path.
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier",
    "unpadded_vocab_size",
)


def _hf_config(model: nn.Module) -> PretrainedConfig | None:
    """The HF config of `model` or of the model a DeepSpeed engine wraps (whose own `config` is DeepSpeed's)."""
    for m in (model, getattr(model, "module", None)):
        config = getattr(m, "config", None)
        if isinstance(config, PretrainedConfig):
            return config
    return None


def chunkable_head(model: nn.Module) -> bool:
    """Whether the chunked vocab projection gives `model`'s own log-probs: its output embedding is a plain nn.Linear
    (FSDP2's FSDPLinear included), whose forward nobody replaced (accelerate's hooks do), and its config sets no
    transform its forward applies to the logits after it."""
    head = model.get_output_embeddings()  # type: ignore[operator]  # an HF model's method
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward or "forward" in vars(head):
        return False
    config = _hf_config(model)
    if config is None:
        return False
    for c in (config, config.get_text_config()):
        if any(getattr(c, name, None) not in (None, 1) for name in _LOGIT_TRANSFORMS):
            return False
    return True


@contextmanager
def vocab_log_probs(
    model: nn.Module, targets: torch.Tensor, temperature: float, chunk: int, with_entropy: bool
) -> Iterator[None]:
    """While open, `model`'s output embedding maps hidden states [*, n, H] to the log-prob of `targets` [*, n] and the
    entropy under softmax(logits / temperature), stacked as [*, n, 2] fp32 ([*, n, 1]: log-prob only), computed
    `chunk` positions at a time (rlrun.algo.vocab_chunks); the model's forward hands that through as `out.logits`.

    The head's forward is replaced (an instance attribute) rather than the head bypassed, so the call still goes
    through nn.Module.__call__: the hooks of FSDP2 (root parameters gathered) and DeepSpeed ZeRO-3 (the head's weight
    gathered) run as for the logits, and their backward hooks fire on the returned tensor. Combine with
    `projected_only` (open it first) to feed the head only some positions."""
    head = model.get_output_embeddings()  # type: ignore[operator]  # an HF model's method

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[:-1] != targets.shape:
            raise ValueError(
                f"the vocab projection got hidden states {tuple(hidden.shape)} for targets {tuple(targets.shape)}"
            )
        logp, entropy = chunked_log_probs(
            hidden.reshape(-1, hidden.shape[-1]),
            head.weight,
            head.bias,
            targets.reshape(-1),
            temperature,
            chunk,
            with_entropy,
        )
        parts = (logp,) if entropy is None else (logp, entropy)
        # stacked last, not viewed after: FSDP2 warns on every call when a wrapped module returns a view
        return torch.stack([part.view(targets.shape) for part in parts], dim=-1)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def response_log_probs(
    model: nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    temperature: float,
    with_entropy: bool = False,
    logits_chunk: int = LOGITS_CHUNK,
    vision: RowVision | None = None,
    routing: torch.Tensor | None = None,
    moe: RoutingRun | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, L] -> log-probs of the last `response_width` tokens [b, R] (and their entropy [b, R]).

    Logits are divided by the sampling temperature so the ratio is taken against the policy
    that actually sampled the tokens. Only the R + 1 last positions go through the vocab projection,
    `logits_chunk` positions at a time where the model allows it (chunkable_head; <= 0: all at once).
    `vision`: the rows' images, for a vision-language policy (its pixels and multimodal positions join the call).
    `moe`: a MoE policy's forward runs tapped (replaying `routing` [b, L, layers, k] when it says so)."""
    kwargs = {
        "input_ids": sequences,
        "attention_mask": attention_mask,
        "use_cache": False,
        "position_ids": position_ids_from(attention_mask),
        "logits_to_keep": response_width + 1,
    }
    if vision is not None:
        kwargs.update(padded_inputs(model, sequences, attention_mask, vision))
    targets = sequences[:, -response_width:]
    tap = nullcontext() if moe is None else moe.around(model, in_forward_order(routing, None), attention_mask.bool())
    if logits_chunk > 0 and chunkable_head(model):
        # The last of the R + 1 positions predicts past the sequence: a dummy target (0) keeps the head's input and
        # the targets aligned; that one extra row per sequence is dropped below.
        with tap, vocab_log_probs(model, F.pad(targets, (0, 1)), temperature, logits_chunk, with_entropy):
            per_token = model(**kwargs).logits[:, :-1]  # [b, R, 1 or 2]
        return per_token[..., 0], per_token[..., 1] if with_entropy else None
    with tap:
        out = model(**kwargs)
    logits = out.logits[:, :-1, :].float()
    logp = log_probs_from_logits(logits, targets, temperature)
    entropy = entropy_from_logits(logits / temperature) if with_entropy else None
    return logp, entropy


def response_values(
    model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor, response_width: int
) -> torch.Tensor:
    """[b, L] -> value of the state before each response token [b, R]."""
    return model(sequences, attention_mask)[:, -response_width - 1 : -1]


def last_token_scores(
    model: nn.Module,
    sequences: torch.Tensor,
    attention_mask: torch.Tensor,
    response_len: torch.Tensor,
    response_width: int,
) -> torch.Tensor:
    """[b, L] -> the scalar head at each row's last real token [b]."""
    values = model(sequences, attention_mask)
    last = sequences.shape[1] - response_width + response_len - 1
    return values.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1)


# ---- packed rows ------------------------------------------------------------------------------


def _attn_implementation(model: nn.Module) -> str | None:
    """The attention kernel of `model`'s transformers model, through rlrun's scalar-head wrapper (`hf`) and
    DeepSpeed's engine (`module`, whose own `config` is DeepSpeed's)."""
    for outer in (model, getattr(model, "module", None)):
        for inner in (outer, getattr(outer, "hf", None)):
            config = getattr(inner, "config", None)
            if isinstance(config, PretrainedConfig):
                return getattr(config, "_attn_implementation", None)
    return None


@contextmanager
def projected_only(model: nn.Module, keep: torch.Tensor) -> Iterator[None]:
    """While open, `model`'s vocab projection sees only the hidden states at `keep` ([n, W] bool): logits come
    out as [1, N, V] in row-major order of `keep`. A pre-hook on the output embedding rather than HF's
    `logits_to_keep`, which takes a 2-D mask only from transformers 5.2x on (5.17 indexes `hidden[:, mask]` and
    fails: seen on an H200 with --packing_samples); the hook works on every version and under FSDP2 and
    DeepSpeed, whose wrappers hand the call through to the same module."""
    head = model.get_output_embeddings()  # type: ignore[operator]  # an HF model's method

    def trim(_module: nn.Module, args: tuple) -> tuple:
        return (args[0][keep].unsqueeze(0), *args[1:])

    handle = head.register_forward_pre_hook(trim)
    try:
        yield
    finally:
        handle.remove()


def pack_for(model: nn.Module, part: RolloutBatch, sp: SequenceParallel | None = None) -> PackedBatch:
    """Pack `part` for `model`'s attention kernel: one row for varlen kernels, else rows no wider than
    the padded batch (a dense block-diagonal mask over a wider row would cost more than padding); with sequence
    parallelism, rows as wide as a multiple of its size (each rank takes its share of the columns)."""
    multiple = 1 if sp is None else sp.size
    one_row = multiple == 1 and _attn_implementation(model) in _VARLEN_ATTENTION
    return pack_batch(part, None if one_row else part.sequences.shape[1], width_multiple=multiple)


def _packed_kwargs(model: nn.Module, part: RolloutBatch, packed: PackedBatch, call: UlyssesCall | None = None) -> dict:
    """The forward's inputs; with sequence parallelism this rank's columns, their global positions, and the call."""
    if call is not None:
        if part.vision is not None:
            raise ValueError("sequence parallelism does not run vision-language inputs yet")
        cols = call.columns
        return {
            "input_ids": packed.input_ids[:, cols],
            "position_ids": packed.position_ids[:, cols],
            "attention_mask": no_mask(packed.input_ids.device),
            "use_cache": False,
            "ulysses": call,
        }
    kwargs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids, "use_cache": False}
    if part.vision is not None:
        kwargs.update(packed_inputs(model, part, packed))
    return kwargs


def _ulysses(model: nn.Module, sp: SequenceParallel | None, packed: PackedBatch) -> UlyssesCall | None:
    """The call a packed forward passes: its sequence-parallel split, or (a model whose attention is ULYSSES without
    one) its packed rows to attend sequence by sequence; None: the model's own kernel sees the packed positions."""
    if sp is not None and sp.size > 1:
        return UlyssesCall(sp, packed.position_ids)
    return UlyssesCall(None, packed.position_ids) if _attn_implementation(model) == ULYSSES else None


def _local_columns(packed: PackedBatch, call: UlyssesCall) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the predicting positions: ([n, S/sp] bool, in its columns; their targets [N_r], read
    from the whole row, so a position at a column boundary predicts the next rank's first token)."""
    cols = call.columns
    keep = packed.keep_mask()[:, cols]
    rows, local = keep.nonzero(as_tuple=True)
    flat = rows * packed.input_ids.shape[1] + local + cols.start
    return keep, packed.input_ids.reshape(-1)[flat + 1]


def _gathered(values: torch.Tensor, keep: torch.Tensor, call: UlyssesCall) -> torch.Tensor:
    """Per-position values [N_r, c] at this rank's `keep` positions -> every rank's, [n * S, c] in row-major order
    (differentiable: the gather's backward hands each rank its own)."""
    dense = values.new_zeros(*keep.shape, values.shape[-1])
    dense[keep] = values
    assert call.sp is not None  # a split call's
    full = gather_columns(dense, call.sp)
    return full.reshape(-1, values.shape[-1])


def packed_response_log_probs(
    model: nn.Module,
    part: RolloutBatch,
    temperature: float,
    with_entropy: bool = False,
    logits_chunk: int = LOGITS_CHUNK,
    sp: SequenceParallel | None = None,
    moe: RoutingRun | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same as response_log_probs on `part` ([b, L] -> [b, R], 0 where there is no response token),
    computed on packed rows; the vocab projection runs on the N response positions only. With sequence parallelism
    each rank of `sp` runs its columns and projects its positions, and the per-token values are gathered."""
    packed = pack_for(model, part, sp)
    call = _ulysses(model, sp, packed)
    kwargs = _packed_kwargs(model, part, packed, call)
    if call is not None and call.split:
        keep, targets = _local_columns(packed, call)
    else:
        keep, targets = packed.keep_mask(), packed.targets()
    tap = nullcontext() if moe is None else _packed_tap(moe, model, part, packed, call)
    if logits_chunk > 0 and chunkable_head(model):
        with (
            tap,
            projected_only(model, keep),
            vocab_log_probs(model, targets.unsqueeze(0), temperature, logits_chunk, with_entropy),
        ):
            per_token = model(**kwargs).logits[0]  # [N or N_r, 1 or 2]
    else:
        with tap, projected_only(model, keep):
            out = model(**kwargs)
        logits = out.logits.reshape(-1, out.logits.shape[-1]).float()  # [N or N_r, V], row-major order of keep
        logp = log_probs_from_logits(logits.unsqueeze(0), targets.unsqueeze(0), temperature)[0]
        parts = [logp] + ([entropy_from_logits(logits / temperature)] if with_entropy else [])
        per_token = torch.stack(parts, dim=-1)
    if call is not None and call.split:
        per_token = _gathered(per_token, keep, call)[packed.pred_index]
    return packed.scatter(per_token[:, 0]), packed.scatter(per_token[:, 1]) if with_entropy else None


def _packed_tap(
    moe: RoutingRun, model: nn.Module, part: RolloutBatch, packed: PackedBatch, call: UlyssesCall | None
) -> AbstractContextManager[None]:
    """moe.around for a packed forward (this rank's columns with sequence parallelism)."""
    assert packed.source is not None  # pack_batch sets it
    source = packed.source if call is None else packed.source[:, call.columns]
    return moe.around(model, in_forward_order(part.routing, source), source >= 0, source)


def _packed_head(model: nn.Module, part: RolloutBatch, sp: SequenceParallel | None) -> tuple[PackedBatch, torch.Tensor]:
    """A scalar-head model on packed rows: (the packing, its values at every position [n * W])."""
    packed = pack_for(model, part, sp)
    call = _ulysses(model, sp, packed)
    if call is None:
        values = model(packed.input_ids, position_ids=packed.position_ids)  # [n, W]
        return packed, values.reshape(-1)
    cols = call.columns
    local = model(  # [n, W/sp]
        packed.input_ids[:, cols],
        attention_mask=no_mask(packed.input_ids.device),
        position_ids=packed.position_ids[:, cols],
        ulysses=call,
    )
    if not call.split:
        return packed, local.reshape(-1)
    assert call.sp is not None  # a split call's
    return packed, gather_columns(local.unsqueeze(-1), call.sp).reshape(-1)


def packed_response_values(model: nn.Module, part: RolloutBatch, sp: SequenceParallel | None = None) -> torch.Tensor:
    """Same as response_values on `part` ([b, R], 0 where there is no response token), on packed rows."""
    packed, values = _packed_head(model, part, sp)
    return packed.scatter(values[packed.pred_index])


def packed_last_token_scores(model: nn.Module, part: RolloutBatch, sp: SequenceParallel | None = None) -> torch.Tensor:
    """Same as last_token_scores on `part` ([b]), on packed rows."""
    packed, values = _packed_head(model, part, sp)
    return values[packed.last_index]


# ---- what the roles call ----------------------------------------------------------------------


def policy_log_probs(
    model: nn.Module,
    part: RolloutBatch,
    temperature: float,
    *,
    with_entropy: bool = False,
    packing: bool = False,
    logits_chunk: int = LOGITS_CHUNK,
    sp: SequenceParallel | None = None,
    moe: RoutingRun | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, L] rollouts -> response log-probs [b, R] (and entropy), padded or packed; the vocab projection runs
    `logits_chunk` positions at a time (<= 0: whole micro-batch, the same numbers with more memory). `sp`: the
    rank's sequence-parallel group (packed rows only). `moe`: a MoE policy's routing bookkeeping (RoutingRun)."""
    if packing or sp is not None:
        return packed_response_log_probs(model, part, temperature, with_entropy, logits_chunk, sp, moe)
    return response_log_probs(
        model,
        part.sequences,
        part.attention_mask,
        part.response_width,
        temperature,
        with_entropy,
        logits_chunk,
        part.vision,
        part.routing,
        moe,
    )


def token_values(
    model: nn.Module, part: RolloutBatch, *, packing: bool = False, sp: SequenceParallel | None = None
) -> torch.Tensor:
    """[b, L] rollouts -> values before each response token [b, R], padded or packed."""
    if packing or sp is not None:
        return packed_response_values(model, part, sp)
    return response_values(model, part.sequences, part.attention_mask, part.response_width)


def sequence_scores(
    model: nn.Module, part: RolloutBatch, *, packing: bool = False, sp: SequenceParallel | None = None
) -> torch.Tensor:
    """[b, L] rollouts -> scalar head at each sequence's last real token [b], padded or packed."""
    if packing or sp is not None:
        return packed_last_token_scores(model, part, sp)
    return last_token_scores(model, part.sequences, part.attention_mask, part.response_len, part.response_width)


def micro_batches(num_rows: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, num_rows)) for i in range(0, num_rows, size)]


def micro_parts(
    batch: RolloutBatch, micro_batch: int | TokenBudget, device: torch.device
) -> Iterator[tuple[torch.Tensor, RolloutBatch]]:
    """(row indices [b], those rows on `device`) per micro-batch of an inference pass: `micro_batch` rows at a time,
    or (--dynamic_batch) by a token budget: micro-batches of similar lengths, each trimmed to its own longest prompt
    and response, as many as on the role's other ranks (a collective)."""
    if isinstance(micro_batch, TokenBudget):
        for rows in micro_batch.split(RowLengths.of(batch)):
            yield rows, trim_padding(batch.rows(rows)).to(device)
        return
    every = torch.arange(batch.sequences.shape[0])
    for part in micro_batches(batch.sequences.shape[0], micro_batch):
        yield every[part], batch.rows(part).to(device)


@torch.no_grad()
def over_micro_batches(
    model: nn.Module,
    batch: RolloutBatch,
    micro_batch: int | TokenBudget,
    device: torch.device,
    fn: Callable[[RolloutBatch], torch.Tensor],
) -> torch.Tensor:
    """Inference in micro-batches (`micro_parts`): fn(part on device) -> [b, ...]; results on CPU in the rows'
    order, per-token ones [b, R] (a trimmed part's padded back)."""
    model.eval()
    parts, outs = [], []
    for rows, part in micro_parts(batch, micro_batch, device):
        parts.append(rows)
        outs.append(pad_responses(fn(part).float().cpu(), batch.response_width))
    return restore_order(parts, outs)


def fed_tokens(model: nn.Module, part: RolloutBatch, packing: bool, sp_size: int = 1) -> int:
    """Token positions a forward over `part` feeds `model` (over a sequence-parallel group's ranks together): the
    [b, L] padded rows, or (--packing_samples) the packed rows pack_for builds, n x W (one row of the real tokens for
    varlen kernels; W a multiple of the group's size). Real tokens are part.attention_mask.sum(); the difference is
    padding (the padded-token fraction of training)."""
    if not packing and sp_size == 1:
        return part.sequences.numel()
    lengths = (part.prompt_len + part.response_len).tolist()
    one_row = _attn_implementation(model) in _VARLEN_ATTENTION
    rows = assign_rows(lengths, None if one_row else part.sequences.shape[1])
    width = max((sum(lengths[i] for i in row) for row in rows), default=1)
    return max(len(rows), 1) * (-(-width // sp_size) * sp_size)
