"""Saving the trained policy in Hugging Face format (safetensors + config + tokenizer).

A model trained with LoRA (--lora_rank) is saved as PEFT saves it, the layout `PeftModel.from_pretrained(base, path)`,
`AutoPeftModelForCausalLM` and transformers' `from_pretrained(path)` (with peft installed) load onto the base:
adapter_model.safetensors (`base_model.model.<module>.lora_A.weight` / `.lora_B.weight`) + adapter_config.json
(rank, alpha, target_modules, base_model_name_or_path: the base's folder, or its hub id and commit) + the
tokenizer. No config.json beside them: transformers would take the folder for a whole model (OpenRLHF writes one,
and its LoRA saves then fail to load that way). A scalar model (critic, reward model) is a SEQ_CLS adapter whose
score head, trained whole, is saved with it under PEFT's modules_to_save convention (`base_model.model.score.weight`);
load its base with num_labels=1. Its --normalize_reward mean/std, which an adapter config cannot hold, go to
reward_norm.json. A base no folder holds (the embedded tiny model, a body merged from an adapter) is written to
<path>/base and named by that absolute path. With `merged` (--save_merged), <path>/merged also gets the merged
model (base + alpha/r * B @ A) in plain HF format with the tokenizer.

No rank gathers a sharded model whole for an export: a model without adapters streams into its files one FSDP
unit / ZeRO-3 block at a time (rlrun.roles.export), and an adapter whose base is on disk gathers only the
adapters. The whole state is gathered on the writer only for --save_merged, for a base no folder holds, and for a
model whose weights transformers converts on save other than by renaming or splitting fused MoE experts back into
the checkpoint's per-expert tensors (which stream: each expert's tensor is a slice of its gathered block).

An export is what a user takes away from a run, so it refuses weights that are not finite (naming the tensor)
unless asked (--export_nonfinite), and a refused write (disk full, read-only, permission) is one line naming
the path and the space needed.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlrun.models.hub import snapshot_repo
from rlrun.models.loading import REWARD_NORM_FILE, ScalarHeadModel, config_mean_std, score_head
from rlrun.models.lora import (
    ADAPTER,
    PEFT_PREFIX,
    hf_name,
    is_adapter,
    merged_state_dict,
    peft_model_of,
    saved_adapter_name,
)
from rlrun.models.safetensors import DTYPE_NAMES, SafetensorsLayout, StreamedSafetensors, TensorSpec, unshared
from rlrun.roles.actor import Actor
from rlrun.roles.critic import Critic
from rlrun.runtime.errors import ConfigError, storage_cause, storage_error
from rlrun.strategies.base import Strategy
from rlrun.strategies.blocks import GatherScratch, is_sharded

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

# ---- weight files ------------------------------------------------------------------------------------------------
# An export's weight files, written one gathered block at a time, and the checks every export makes.
#
# A trained model is sharded over its role (FSDP2, DeepSpeed ZeRO-3). Gathering it whole on the writer before
# writing, as `save_pretrained(state_dict=...)` needs, would hold the whole model in fp32 on one rank (280 GB of host
# RAM for a 70B policy). Instead every rank gathers one FSDP unit / ZeRO-3 block at a time (`Strategy.export_view`)
# and the writer puts each tensor straight into its place in the safetensors files (rlrun.models.safetensors),
# so it holds one block on top of its shards.
#
# The files are the ones `save_pretrained` writes, decided by transformers' own rules run on stand-in tensors: tied
# weights saved once under the name transformers keeps, `_keys_to_ignore_on_save` left out, names reverted to the
# checkpoint's (transformers 5's `revert_weight_conversion`), the same file split and index. Where that cannot be
# promised without the tensors themselves (a quantized model, a conversion that is more than a renaming or the split
# of fused MoE experts into per-expert slices; a dtype safetensors lacks), `export_sources` says no and the export
# gathers the whole model as before (rlrun.roles.export).
#
# Exports refuse NaN/inf weights (naming the tensor) unless asked, and a refused write (disk full, read-only,
# permission) is one line naming the path and the space needed.


class NonFiniteWeights(ConfigError):
    """An export would write NaN/inf weights."""


def nonfinite_count(t: torch.Tensor) -> int:
    """How many of `t`'s values are NaN/inf (0 for integer tensors)."""
    if not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return 0
    return int((~torch.isfinite(t)).sum())


def refuse_nonfinite(bad: list[tuple[str, int]], path: str, flag: str) -> None:
    """NonFiniteWeights naming the first (name, NaN/inf count) of `bad` (and how many tensors have them)."""
    if bad:
        name, count = bad[0]
        more = f" (and {len(bad) - 1} more tensors)" if len(bad) > 1 else ""
        raise NonFiniteWeights(
            f"not exporting to {path}: weight {name} has {count} NaN/inf values{more}; the run "
            "diverged or loaded a damaged checkpoint. Pass --export_nonfinite to write it anyway "
            f"({flag})"
        )


def make_export_dir(path: str, flag: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {path} ({flag}): {exc.strerror}") from None


@contextlib.contextmanager
def storage_errors(path: str, needs_bytes: int, flag: str) -> Iterator[None]:
    """A refused write inside as one StorageError line (path, reason, space needed and free)."""
    try:
        yield
    except OSError as exc:
        cause = storage_cause(exc)
        if cause is None:
            raise
        raise storage_error(
            "the model", path, cause, needs_bytes, f"free space there or choose another {flag}"
        ) from None


@dataclass(frozen=True)
class Piece:
    """Rows [begin, end) of slice `index` (dim 0) of a source: one expert's tensor of a fused MoE parameter, saved in
    the checkpoint's per-expert layout."""

    index: int
    begin: int
    end: int


@dataclass(frozen=True)
class ExportSources:
    """What a streamed export writes: `sources[saved name]` is the parameter or buffer (the user model's name)
    holding it, all of it or `pieces[saved name]` of it; `buffers`: the sources that are buffers (read on the
    writer, never gathered)."""

    sources: dict[str, str]
    layout: SafetensorsLayout
    buffers: frozenset[str]
    pieces: dict[str, Piece] = field(default_factory=dict)


def _entries(
    model: nn.Module, shapes: dict[str, TensorSpec]
) -> tuple[dict[str, str], dict[str, TensorSpec], set[str]] | None:
    """(state-dict name -> canonical source name, source -> spec, buffer sources) of `model`, or None when a
    buffer is sharded (it would need a collective only the writer makes)."""
    canonical: dict[int, str] = {id(p): n for n, p in model.named_parameters()}
    buffers = {id(b): n for n, b in model.named_buffers()}
    specs = dict(shapes)
    sources: dict[str, str] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in canonical:
            sources[key] = canonical[id(value)]
        elif id(value) in buffers and not is_sharded(value):
            sources[key] = buffers[id(value)]
            specs[sources[key]] = TensorSpec(tuple(value.shape), value.dtype)
        else:
            return None
    used = set(sources.values())
    return sources, specs, {n for n in buffers.values() if n in used}


def export_sources(
    model: nn.Module,
    shapes: dict[str, TensorSpec],
    *,
    as_transformers: bool,
    saved_name: Callable[[str], str] = lambda name: name,
) -> ExportSources | None:
    """The files a streamed export of `model` writes. `shapes`: every parameter's full shape and dtype (the
    blocks' `shapes()`). `as_transformers`: `model` is a transformers model, named as save_pretrained names it;
    otherwise every state-dict name is written under `saved_name(name)` (tied ones once each). None: streaming
    cannot write what save_pretrained would (see the module docstring). Deterministic in the model alone, so
    every rank of the role reaches the same answer."""
    found = _entries(model, shapes)
    if found is None:
        return None
    sources, specs, buffers = found
    if any(specs[s].dtype not in DTYPE_NAMES for s in sources.values()):
        return None
    total_parameters, pieces = None, {}
    if as_transformers:
        kept = _saved_by_transformers(cast(PreTrainedModel, model), sources, specs)  # as_transformers
        if kept is None:
            return None
        sources = {k: source for k, (source, _) in kept.items()}
        pieces = {k: piece for k, (_, piece) in kept.items() if piece is not None}
        total_parameters = sum(math.prod(specs[s].shape) for s in set(sources.values()) - buffers)
    else:
        sources = {saved_name(k): s for k, s in sources.items()}
    layout = SafetensorsLayout(
        {k: _piece_spec(specs[s], pieces.get(k)) for k, s in sources.items()}, total_parameters=total_parameters
    )
    return ExportSources(sources, layout, frozenset(buffers), pieces)


def _piece_spec(spec: TensorSpec, piece: Piece | None) -> TensorSpec:
    return spec if piece is None else TensorSpec((piece.end - piece.begin, *spec.shape[2:]), spec.dtype)


Saved = tuple[str, "Piece | None"]  # (source, the piece of it saved; None: all of it)


def _saved_by_transformers(
    hf: PreTrainedModel, sources: dict[str, str], specs: dict[str, TensorSpec]
) -> dict[str, Saved] | None:
    """{saved name: (source, piece)} as save_pretrained names and splits `hf`'s state dict, found by running
    transformers' own steps on stand-ins: tied names removed, ignored keys dropped, weight conversions reverted.
    A source of 1 or 2 dims gets a one-element stand-in (one per source, so tied names share one, as tied tensors
    share storage) found again by identity; a 3-dim one (fused MoE experts) a [d0, d1, 1...] tensor numbering its
    rows, so each tensor the conversion splits from it says which expert and rows it is. None: a quantized model, or
    a conversion that makes anything else (new values, other splits)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion  # noqa: PLC0415 - not in every version
        from transformers.modeling_utils import remove_tied_weights_from_state_dict  # noqa: PLC0415
    except ImportError:  # a transformers without these steps: gather whole, as before
        return None
    if getattr(hf, "hf_quantizer", None) is not None:
        return None
    numbered = _Numbered({s: specs[s].shape for s in set(sources.values()) if len(specs[s].shape) >= 3})
    stand_in = {s: numbered.stand_in(s) if s in numbered.first else torch.zeros(1) for s in set(sources.values())}
    state = {k: stand_in[s] for k, s in sources.items()}
    for key in getattr(hf, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, hf)
    try:
        reverted = revert_weight_conversion(hf, dict(state))
    except Exception:  # noqa: BLE001 - a converter that needs real shapes makes new tensors: no stream
        return None
    owner = {id(t): s for s, t in stand_in.items()}
    out: dict[str, Saved] = {}
    for key, t in reverted.items():
        found = (owner[id(t)], None) if id(t) in owner else numbered.piece_of(t)
        if found is None:
            return None
        out[key] = found
    if len(set(out.values())) != len(out) or not numbered.covered([saved for saved in out.values() if saved[1]]):
        return None
    return out


class _Numbered:
    """Stand-ins for 3-dim sources numbering their [d0, d1] rows (int64, one range per source), and the pieces
    tensors split from them are."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        self.shapes, self.first, start = shapes, {}, 0
        for name in sorted(shapes):
            self.first[name] = start
            start += shapes[name][0] * shapes[name][1]

    def stand_in(self, name: str) -> torch.Tensor:
        d0, d1, *rest = self.shapes[name]
        rows = torch.arange(self.first[name], self.first[name] + d0 * d1, dtype=torch.int64)
        return rows.view(d0, d1, *[1] * len(rest))

    def piece_of(self, t: torch.Tensor) -> Saved | None:
        """The (source, piece) `t` is: consecutive rows of one slice of one stand-in; None otherwise."""
        if t.dtype != torch.int64 or t.dim() < 2 or t.numel() != t.shape[0] or not t.numel():
            return None
        rows = t.reshape(-1)
        first = int(rows[0])
        if not torch.equal(rows, torch.arange(first, first + rows.numel())):
            return None
        name = next((n for n in self.first if self.first[n] <= first < self._end(n)), None)
        if name is None:
            return None
        d1 = self.shapes[name][1]
        index, begin = divmod(first - self.first[name], d1)
        end = begin + rows.numel()
        return (name, Piece(index, begin, end)) if end <= d1 and t.dim() == len(self.shapes[name]) - 1 else None

    def _end(self, name: str) -> int:
        return self.first[name] + self.shapes[name][0] * self.shapes[name][1]

    def covered(self, saved: list[Saved]) -> bool:
        """Whether the pieces cover every row of every numbered source exactly once."""
        rows = {name: 0 for name in self.shapes}
        for name, piece in saved:
            assert piece is not None
            rows[name] += piece.end - piece.begin
        return all(rows[n] == self.shapes[n][0] * self.shapes[n][1] for n in self.shapes)


def gather_named(
    model: nn.Module, strategy: Strategy, wanted: Callable[[str], bool], *, is_writer: bool
) -> dict[str, torch.Tensor]:
    """CPU copies of the full parameters `wanted` names (the user model's names), on the writer ({} elsewhere),
    gathered one block at a time, skipping blocks that hold none: never the whole model. Collective over the role."""
    out: dict[str, torch.Tensor] = {}
    with strategy.export_view(model) as (_, blocks):
        scratch = GatherScratch()
        for block in blocks:
            names = [name for name, _, _ in block.shapes() if wanted(name)]
            if not names:  # the same on every rank: the names are the model's
                continue
            full = block.gather(scratch)
            if is_writer:
                out.update((name, full.read(name).to("cpu", copy=True)) for name in names)
    return out


PlanFor = Callable[[nn.Module, dict[str, TensorSpec]], "ExportSources | None"]


def stream_weights(
    model: nn.Module,
    strategy: Strategy,
    path: str,
    *,
    is_writer: bool,
    flag: str,
    allow_nonfinite: bool,
    plan_for: PlanFor,
    beside: Callable[[], None],
) -> bool:
    """Gather `model` one block at a time on every rank of its role and, on the writer, write each tensor into
    `path`'s safetensors files, then `beside()` (the config and tokenizer), then put the weights in place; on any
    failure there, no weights. False (on every rank alike, before any collective): `plan_for` says this model
    cannot stream, export it whole. Collective over the role; a failure on the writer (NaN weights, a refused
    write) is raised only after every block was gathered, so no rank is left waiting in a gather."""
    with strategy.export_view(model) as (module, blocks):
        shapes = {n: TensorSpec(tuple(s), d) for block in blocks for n, s, d in block.shapes()}
        plan = plan_for(module, shapes)
        if plan is None:
            return False
        sink = _Sink(plan, path, flag, allow_nonfinite) if is_writer else None
        scratch = GatherScratch()
        for block in blocks:
            full = block.gather(scratch)
            if sink is not None:
                for name in full.names:
                    sink.put(name, full.read(name))
        if sink is None:
            return True
        for name, buffer in module.named_buffers():
            if name in plan.buffers:
                sink.put(name, buffer.detach())
        files = sink.finish()
    try:
        with storage_errors(path, 0, flag):
            beside()
        files.commit()
    except BaseException:
        files.abort()
        raise
    return True


class _Sink:
    """The writer's side of a stream: each source tensor to its saved names, NaN/inf counted, the first failure
    kept (and nothing more written) until `finish` raises it with the files removed."""

    def __init__(self, plan: ExportSources, path: str, flag: str, allow_nonfinite: bool) -> None:
        self.path, self.flag, self.allow_nonfinite = path, flag, allow_nonfinite
        self.needs = plan.layout.total_bytes
        self.pieces = plan.pieces
        self.saved: dict[str, list[str]] = {}
        for key, source in plan.sources.items():
            self.saved.setdefault(source, []).append(key)
        self.bad: list[tuple[str, int]] = []
        self.failure: BaseException | None = None
        self.files: StreamedSafetensors | None = None  # None only with a failure
        try:
            make_export_dir(path, flag)
            with storage_errors(path, self.needs, flag):
                self.files = StreamedSafetensors(plan.layout, path)
        except Exception as exc:  # noqa: BLE001 - raised by finish, once every rank has gathered everything
            self.failure = exc

    def put(self, source: str, tensor: torch.Tensor) -> None:
        if self.failure is not None or source not in self.saved:
            return
        try:
            parts = [(key, self._part(key, tensor)) for key in self.saved[source]]
            # tied names hold one tensor (counted once); the pieces of a fused tensor are named each
            checked = parts if any(key in self.pieces for key, _ in parts) else parts[:1]
            if not self.allow_nonfinite:
                self.bad.extend((key, count) for key, part in checked if (count := nonfinite_count(part)))
            if not self.bad:
                with storage_errors(self.path, self.needs, self.flag):
                    for key, part in parts:
                        self.files.write(key, part)  # type: ignore[union-attr]  # set: no failure
        except Exception as exc:  # noqa: BLE001 - raised by finish, once every rank has gathered everything
            self.failure = exc

    def _part(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        piece = self.pieces.get(key)
        return tensor if piece is None else tensor[piece.index, piece.begin : piece.end]

    def finish(self) -> StreamedSafetensors:
        """The written files (not yet in place), or the first failure raised with the files removed."""
        if self.failure is None and self.bad:
            try:
                refuse_nonfinite(self.bad, self.path, self.flag)
            except NonFiniteWeights as exc:
                self.failure = exc
        if self.failure is not None:
            if self.files is not None:
                self.files.abort()
            raise self.failure
        assert self.files is not None
        return self.files


def check_finite(state: Mapping[str, torch.Tensor], path: str, flag: str) -> None:
    """NonFiniteWeights naming the first tensor with NaN/inf values (and how many tensors have them)."""
    refuse_nonfinite([(name, count) for name, t in state.items() if (count := nonfinite_count(t))], path, flag)


def _storage_errors(path: str, state: Mapping[str, torch.Tensor], flag: str) -> contextlib.AbstractContextManager[None]:
    return storage_errors(path, sum(t.numel() * t.element_size() for t in state.values()), flag)


def save_policy(
    actor: Actor | None,
    tokenizer: PreTrainedTokenizerBase,
    path: str,
    *,
    is_writer: bool,
    strategy: Strategy | None,
    allow_nonfinite: bool = False,
    merged: bool = False,
    image_processor: Any = None,
) -> None:
    """Collective over the actor ranks; the writer (global rank 0, always an actor rank) writes.
    `strategy`: the actor's (RankRoles.strategies), which knows how to assemble its full weights.
    `image_processor`: a vision-language policy's, saved beside it (preprocessor_config.json) so that the export
    loads as the model it is."""
    if actor is None:
        return
    assert strategy is not None, "an actor rank always has the actor's strategy"
    save_causal_lm(
        actor.model,
        tokenizer,
        path,
        is_writer=is_writer,
        strategy=strategy,
        allow_nonfinite=allow_nonfinite,
        merged=merged,
    )
    if is_writer and image_processor is not None:
        with _storage_errors(path, {}, "--save_path"):
            image_processor.save_pretrained(path)


def save_causal_lm(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    path: str,
    *,
    is_writer: bool,
    strategy: Strategy,
    flag: str = "--save_path",
    allow_nonfinite: bool = False,
    merged: bool = False,
) -> None:
    """A (wrapped) causal LM in HF format with its tokenizer; with LoRA adapters, PEFT's adapter layout (and with
    `merged`, the merged model in <path>/merged). Collective over the model's role; the writer must be global rank 0
    (transformers' save_pretrained writes there only). A model without adapters streams to its files one gathered
    block at a time (rlrun.roles.export), where its names allow."""

    def beside() -> None:
        # config.json, generation_config.json (a remote-code model's files too), and the clean-up of a previous
        # save's shards: transformers' own, with no weights to write
        model.save_pretrained(path, state_dict={}, safe_serialization=True)  # type: ignore[operator]  # an HF model's method
        tokenizer.save_pretrained(path)

    if not _holds_adapters(model) and stream_weights(
        model,
        strategy,
        path,
        is_writer=is_writer,
        flag=flag,
        allow_nonfinite=allow_nonfinite,
        beside=beside,
        plan_for=lambda module, shapes: export_sources(module, shapes, as_transformers=True),
    ):
        return
    state = _export_state(model, strategy, is_writer=is_writer, merged=merged, prefix="", head=None)
    if not is_writer:
        return
    if not allow_nonfinite:
        check_finite(state, path, flag)
    with _storage_errors(path, state, flag):
        make_export_dir(path, flag)
        if not _has_adapters(state):
            model.save_pretrained(path, state_dict=state, safe_serialization=True)  # type: ignore[operator]  # an HF model's method
            tokenizer.save_pretrained(path)
            return
        peft_model = _peft_model(model)
        hf = cast(PreTrainedModel, peft_model.get_base_model())  # the causal LM; PEFT types it a Module
        base = _base_name(peft_model)
        if base is None:
            base = (_written_base(path), None)
            hf.save_pretrained(base[0], state_dict=_base_state(state), safe_serialization=True)
        _write_adapter(path, state, peft_model, base, task_type="CAUSAL_LM")
        tokenizer.save_pretrained(path)
        if merged:
            merged_path = os.path.join(path, MERGED_DIR)
            hf.save_pretrained(
                merged_path, state_dict=merged_state_dict(state, _scaling(peft_model)), safe_serialization=True
            )
            tokenizer.save_pretrained(merged_path)


def save_critic(
    critic: Critic,
    path: str,
    *,
    is_writer: bool,
    strategy: Strategy,
    allow_nonfinite: bool = False,
    merged: bool = False,
) -> None:
    """The critic as a sequence-classification model (num_labels 1). Collective over the critic ranks."""
    save_scalar_model(
        cast(ScalarHeadModel, critic.model),  # wrapped: a DeepSpeed engine forwards its attributes
        path,
        is_writer=is_writer,
        strategy=strategy,
        flag="--save_value_network",
        allow_nonfinite=allow_nonfinite,
        merged=merged,
    )


def save_scalar_model(
    model: ScalarHeadModel,
    path: str,
    *,
    is_writer: bool,
    strategy: Strategy,
    flag: str,
    tokenizer: PreTrainedTokenizerBase | None = None,
    allow_nonfinite: bool = False,
    merged: bool = False,
) -> None:
    """A sequence-classification model (num_labels 1; its config carries any mean/std set on it), with the
    tokenizer when given; with LoRA adapters, a SEQ_CLS adapter carrying the score head (and with `merged`, the
    merged model in <path>/merged). Collective over the model's role; `is_writer` may be any rank of it. Without
    adapters, the weights stream one gathered block at a time (rlrun.roles.export)."""
    adapters = _holds_adapters(model)
    if not adapters and stream_weights(
        model,
        strategy,
        path,
        is_writer=is_writer,
        flag=flag,
        allow_nonfinite=allow_nonfinite,
        beside=lambda: _write_scalar_config(model.hf, path, tokenizer),
        plan_for=lambda module, shapes: export_sources(module, shapes, as_transformers=False, saved_name=_hf_key),
    ):
        return
    state = _export_state(
        model,
        strategy,
        is_writer=is_writer,
        merged=merged,
        prefix="hf.",
        head=_head_name(_scalar_hf(model)) if adapters else None,
    )
    if not is_writer:
        return
    if not allow_nonfinite:
        check_finite(state, path, flag)
    with _storage_errors(path, state, flag):
        make_export_dir(path, flag)
        if not _has_adapters(state):
            _write_scalar(model.hf, {_hf_key(k): v for k, v in state.items()}, path, tokenizer)
            return
        peft_model = _peft_model(model)
        hf = _scalar_hf(model)
        head = _head_name(hf)
        base = _base_name(peft_model)
        if base is None:
            base = (_written_base(path), None)
            _write_scalar(hf, {_hf_key(k): v for k, v in _base_state(state).items()}, base[0], None)
        _write_adapter(path, state, peft_model, base, task_type="SEQ_CLS", prefix="hf.", head=head)
        if (norm := config_mean_std(hf.config)) is not None:
            with open(os.path.join(path, REWARD_NORM_FILE), "w") as f:
                json.dump({"mean": norm[0], "std": norm[1]}, f)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        if merged:
            state = merged_state_dict(state, _scaling(peft_model))
            _write_scalar(hf, {_hf_key(k): v for k, v in state.items()}, os.path.join(path, MERGED_DIR), tokenizer)


def _write_scalar(
    hf: PreTrainedModel, state: Mapping[str, torch.Tensor], path: str, tokenizer: PreTrainedTokenizerBase | None
) -> None:
    """config.json + model.safetensors (`hf`, the sequence-classification model, and its names) [+ the tokenizer]."""
    _write_scalar_config(hf, path, tokenizer)
    save_file(unshared(state.items()), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def _write_scalar_config(hf: PreTrainedModel, path: str, tokenizer: PreTrainedTokenizerBase | None) -> None:
    """config.json (`hf`, the sequence-classification model) [+ the tokenizer]."""
    # The writer writes the files itself: transformers' save_pretrained writes on global rank 0 only
    # (should_save_on_this_rank), and a critic on ranks of its own does not hold rank 0.
    os.makedirs(path, exist_ok=True)
    config = hf.config
    config.architectures = [type(hf).__name__.removeprefix("FSDP")]  # a policy's body keeps its causal-LM name
    config.to_json_file(os.path.join(path, "config.json"))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def _hf_key(name: str) -> str:
    """A ScalarHeadModel's state-dict name as the sequence-classification model's own."""
    return name.removeprefix("hf.")


# ---- LoRA exports ------------------------------------------------------------------------------------------------

MERGED_DIR = "merged"  # <save_path>/merged: --save_merged's plain HF model
BASE_DIR = "base"  # <save_path>/base: the base model when no folder or hub id holds it


def _has_adapters(state: Mapping[str, torch.Tensor]) -> bool:
    return any(is_adapter(n) for n in state)


def _holds_adapters(model: nn.Module) -> bool:
    return any(is_adapter(n) for n, _ in model.named_parameters())


def _export_state(
    model: nn.Module, strategy: Strategy, *, is_writer: bool, merged: bool, prefix: str, head: str | None
) -> dict[str, torch.Tensor]:
    """The full state an export without a stream writes from, on the writer ({} elsewhere). An adapter whose base
    a folder or hub id holds, without a merged model: the adapters (and the `head`) alone, gathered one block at a
    time, so no rank holds the base model whole (140 GB of bf16 for a 70B base); otherwise everything.
    Collective over the role."""
    peft_model = peft_model_of(model)
    if peft_model is None or merged or _base_name(peft_model) is None:
        return strategy.full_state_dict(model)
    return gather_named(
        model, strategy, lambda name: _adapter_file_key(name, prefix, head) is not None, is_writer=is_writer
    )


def _head_name(hf: PreTrainedModel) -> str:
    """The score head's module name in a sequence-classification model (trained whole beside the adapters)."""
    return next(n for n, m in hf.named_modules() if m is score_head(hf))


def _adapter_file_key(name: str, prefix: str, head: str | None) -> str | None:
    """`name`'s key in adapter_model.safetensors, as PEFT names it for a model whose root is the whole HF model
    (`prefix` + HF name in the state): an adapter, or the `head` module's weights (modules_to_save); None for the
    base's weights, which the adapter file does not hold."""
    hf = hf_name(name).removeprefix(prefix)  # the HF model's own name (PEFT may wrap the whole model or its body)
    if is_adapter(name):
        return PEFT_PREFIX + saved_adapter_name(hf)
    if head is not None and hf.startswith(head + "."):
        return PEFT_PREFIX + hf  # modules_to_save: saved under the module's own name
    return None


def _peft_model(model: nn.Module) -> PeftModel:
    peft_model = peft_model_of(model)
    assert peft_model is not None, "a state with LoRA tensors comes from a model holding a PEFT model"
    return peft_model


def _scalar_hf(model: ScalarHeadModel) -> PreTrainedModel:
    """The sequence-classification model inside a ScalarHeadModel (unwrapped when PEFT wraps it whole)."""
    hf = model.hf
    inner = getattr(hf, "get_base_model", None)  # a PeftModel around the whole classifier
    return inner() if callable(inner) and peft_model_of(hf) is hf else hf


def _scaling(peft_model: PeftModel) -> float:
    config = cast("LoraConfig", peft_model.peft_config[ADAPTER])  # rlrun adds LoRA adapters only
    assert not config.rank_pattern and not config.alpha_pattern and not config.use_rslora, "rlrun's adapters are plain"
    return config.lora_alpha / config.r


def _base_name(peft_model: PeftModel) -> tuple[str, str | None] | None:
    """(base_model_name_or_path, revision) naming the base the adapter was trained on, portable where possible: a
    hub cache snapshot as its hub id and commit, a folder as its absolute path. None: no folder holds the base.
    PEFT took the name from the HF model's config (`_name_or_path`, the folder it was read from)."""
    name = peft_model.peft_config[ADAPTER].base_model_name_or_path
    if not name:
        return None
    if (hub := snapshot_repo(name)) is not None:
        return hub
    return (os.path.abspath(name), None) if os.path.isdir(name) else (name, None)


def _written_base(path: str) -> str:
    return os.path.abspath(os.path.join(path, BASE_DIR))


def _base_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's weights (HF names) in a PEFT model's full state: the adapters left out."""
    return {hf_name(n): t for n, t in state.items() if not is_adapter(n)}


def _write_adapter(
    path: str,
    state: Mapping[str, torch.Tensor],
    peft_model: PeftModel,
    base: tuple[str, str | None],
    *,
    task_type: str,
    prefix: str = "",
    head: str | None = None,
) -> None:
    """adapter_model.safetensors + adapter_config.json under the names PEFT gives a model of `task_type` whose
    root is the whole HF model (`prefix` + HF name in `state`): the adapters, and the `head` module whole."""
    tensors = {}
    for name, tensor in state.items():
        if (key := _adapter_file_key(name, prefix, head)) is not None:
            tensors[key] = tensor
    save_file(unshared(tensors.items()), os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(cast("LoraConfig", peft_model.peft_config[ADAPTER]))  # rlrun adds LoRA adapters only
    config.base_model_name_or_path, config.revision = base
    config.task_type, config.inference_mode = task_type, True
    config.modules_to_save = None if head is None else [head]
    if isinstance(config.target_modules, set):  # PEFT's expansion of all-linear: a set; the same file every time
        config.target_modules = sorted(config.target_modules)
    config.save_pretrained(path)
