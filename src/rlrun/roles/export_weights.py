"""An export's weight files, written one gathered block at a time, and the checks every export makes.

A trained model is sharded over its role (FSDP2, DeepSpeed ZeRO-3). Gathering it whole on the writer before
writing, as `save_pretrained(state_dict=...)` needs, would hold the whole model in fp32 on one rank (280 GB of host
RAM for a 70B policy). Instead every rank gathers one FSDP unit / ZeRO-3 block at a time (`Strategy.export_view`)
and the writer puts each tensor straight into its place in the safetensors files (rlrun.models.safetensors_stream),
so it holds one block on top of its shards.

The files are the ones `save_pretrained` writes, decided by transformers' own rules run on stand-in tensors: tied
weights saved once under the name transformers keeps, `_keys_to_ignore_on_save` left out, names reverted to the
checkpoint's (transformers 5's `revert_weight_conversion`), the same file split and index. Where that cannot be
promised without the tensors themselves (a quantized model, a conversion that is more than a renaming: MoE experts
fused on load and split again on save; a dtype safetensors lacks), `plan_weights` says no and the export gathers
the whole model as before (rlrun.roles.export).

Exports refuse NaN/inf weights (naming the tensor) unless asked, and a refused write (disk full, read-only,
permission) is one line naming the path and the space needed.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from rlrun.models.safetensors_stream import DTYPE_NAMES, SafetensorsLayout, StreamedSafetensors, TensorSpec
from rlrun.launch.param_blocks import GatherScratch, is_sharded
from rlrun.runtime.errors import ConfigError
from rlrun.runtime.storage import storage_cause, storage_error
from rlrun.strategies.base import Strategy


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
        raise NonFiniteWeights(f"not exporting to {path}: weight {name} has {count} NaN/inf values{more}; the run "
                               "diverged or loaded a damaged checkpoint. Pass --export_nonfinite to write it anyway "
                               f"({flag})")


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
        raise storage_error("the model", path, cause, needs_bytes, f"free space there or choose another {flag}") from None


@dataclass(frozen=True)
class WeightPlan:
    """What a streamed export writes: `sources[saved name]` is the parameter or buffer (the user model's name)
    holding it; `buffers`: the sources that are buffers (read on the writer, never gathered)."""

    sources: dict[str, str]
    layout: SafetensorsLayout
    buffers: frozenset[str]


def _entries(model: nn.Module, shapes: dict[str, TensorSpec]) -> tuple[dict[str, str], dict[str, TensorSpec], set[str]] | None:
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


def plan_weights(model: nn.Module, shapes: dict[str, TensorSpec], *, as_transformers: bool,
                 saved_name: Callable[[str], str] = lambda name: name) -> WeightPlan | None:
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
    total_parameters = None
    if as_transformers:
        kept = _saved_by_transformers(model, sources)
        if kept is None:
            return None
        sources = kept
        total_parameters = sum(math.prod(specs[s].shape) for s in set(sources.values()) - buffers)
    else:
        sources = {saved_name(k): s for k, s in sources.items()}
    layout = SafetensorsLayout({k: specs[s] for k, s in sources.items()}, total_parameters=total_parameters)
    return WeightPlan(sources, layout, frozenset(buffers))


def _saved_by_transformers(hf: nn.Module, sources: dict[str, str]) -> dict[str, str] | None:
    """{saved name: source} as save_pretrained names `hf`'s state dict, found by running transformers' own steps
    on one-element stand-ins (one per source, so tied names share one, as tied tensors share storage): tied names
    removed, ignored keys dropped, weight conversions reverted. None: a quantized model, or a conversion that
    makes new tensors (more than a renaming)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # a transformers without these steps: gather whole, as before
        return None
    if getattr(hf, "hf_quantizer", None) is not None:
        return None
    stand_in = {s: torch.zeros(1) for s in set(sources.values())}
    state = {k: stand_in[s] for k, s in sources.items()}
    for key in getattr(hf, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, hf)
    try:
        reverted = revert_weight_conversion(hf, dict(state))
    except Exception:  # noqa: BLE001 - a converter that needs real shapes makes new tensors: no stream
        return None
    owner = {id(t): s for s, t in stand_in.items()}
    out = {k: owner.get(id(t)) for k, t in reverted.items()}
    if any(s is None for s in out.values()) or len(set(out.values())) != len(out):
        return None
    return out  # type: ignore[return-value]  # no None left


def gather_named(model: nn.Module, strategy: Strategy, wanted: Callable[[str], bool], *,
                 is_writer: bool) -> dict[str, torch.Tensor]:
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


PlanFor = Callable[[nn.Module, dict[str, TensorSpec]], "WeightPlan | None"]


def stream_weights(model: nn.Module, strategy: Strategy, path: str, *, is_writer: bool, flag: str,
                   allow_nonfinite: bool, plan_for: PlanFor, beside: Callable[[], None]) -> bool:
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

    def __init__(self, plan: WeightPlan, path: str, flag: str, allow_nonfinite: bool) -> None:
        self.path, self.flag, self.allow_nonfinite = path, flag, allow_nonfinite
        self.needs = plan.layout.total_bytes
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
            if not self.allow_nonfinite and (count := nonfinite_count(tensor)):
                self.bad.append((self.saved[source][0], count))
            if not self.bad:
                with storage_errors(self.path, self.needs, self.flag):
                    for key in self.saved[source]:
                        self.files.write(key, tensor)  # type: ignore[union-attr]  # set: no failure
        except Exception as exc:  # noqa: BLE001 - raised by finish, once every rank has gathered everything
            self.failure = exc

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
