"""Where a model's initial weights come from, read a slice at a time, and how a model built on the meta device is
filled from them: whole on one device, or (with the FSDP strategy's reader) as this rank's shards only.

A sharded rank reads only the rows of each tensor it keeps (safetensors slices of a memory-mapped file), so no
rank, not even the first, holds a whole sharded model; a whole model is read straight into its device and dtype,
one tensor at a time. Sources: an HF directory (`FileWeights`: safetensors, or zip-format `.bin` memory-mapped,
single file or index), a state dict in memory (`MemoryWeights`: the embedded tiny model, seeded score heads), or
several in order (`Chained`); a checkpoint read under the names transformers converts it to: rlrun.models.conversions.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol

import torch
from torch import nn
from typing_extensions import TypeVar

from rlrun.models.safetensors import SafetensorsReader
from rlrun.runtime.errors import ConfigError

if TYPE_CHECKING:
    from safetensors import safe_open

Rows = tuple[int, int]  # [begin, end) along dim 0


class WeightSource(Protocol):
    def shape(self, name: str) -> tuple[int, ...] | None:
        """The tensor's full shape, None when the source does not have it."""
        ...

    def read(self, name: str, rows: Rows | None) -> torch.Tensor:
        """Rows [begin, end) of `name` (all of it for None), in the stored dtype, on the CPU."""
        ...


class MemoryWeights:
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...] | None:
        t = self.tensors.get(name)
        return None if t is None else tuple(t.shape)

    def read(self, name: str, rows: Rows | None) -> torch.Tensor:
        t = self.tensors[name]
        return t if rows is None else t[rows[0] : rows[1]]


class Chained:
    """The first source that has a name answers for it (overrides first, the checkpoint last)."""

    def __init__(self, *sources: WeightSource) -> None:
        self.sources = sources

    def _owner(self, name: str) -> WeightSource | None:
        return next((s for s in self.sources if s.shape(name) is not None), None)

    def shape(self, name: str) -> tuple[int, ...] | None:
        owner = self._owner(name)
        return None if owner is None else owner.shape(name)

    def read(self, name: str, rows: Rows | None) -> torch.Tensor:
        owner = self._owner(name)
        assert owner is not None, name
        return owner.read(name, rows)


_INDEXES = (
    ("model.safetensors.index.json", "model.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    (None, "adapter_model.safetensors"),
    (None, "adapter_model.bin"),
)  # a PEFT adapter directory


class FileWeights:
    """An HF model directory's weight files, opened once and read a slice at a time (safetensors with pread:
    rlrun.models.safetensors; a .bin memory-mapped)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file_of: dict[str, str] = {}
        self._open: dict[str, object] = {}
        self._index: str | None = None
        for index, single in _INDEXES:
            if index is not None and os.path.isfile(os.path.join(path, index)):
                with open(os.path.join(path, index)) as f:
                    self._file_of = dict(json.load(f)["weight_map"])
                self._index = index
                break
            if os.path.isfile(os.path.join(path, single)):
                self._file_of = {name: single for name in self._names_in(single)}
                break
        if not self._file_of:
            raise ConfigError(
                f"{path}: no model.safetensors, pytorch_model.bin or their .index.json; save the model "
                "with save_pretrained"
            )

    def _handle(self, file: str) -> object:
        if file not in self._open:
            full = os.path.join(self.path, file)
            if file.endswith(".safetensors"):
                reader: SafetensorsReader | safe_open
                reader = SafetensorsReader(full)  # pread, not mmap: read pages do not stay in this rank's RSS
                if not reader.knows_every_dtype():
                    reader.close()
                    from safetensors import safe_open  # noqa: PLC0415 - transformers' own dependency

                    reader = safe_open(full, framework="pt", device="cpu")
                self._open[file] = reader
            else:  # zip-format .bin (torch >= 1.6): memory-mapped, so a slice reads only its pages
                self._open[file] = torch.load(full, map_location="cpu", mmap=True, weights_only=True)
        return self._open[file]

    def names(self) -> list[str]:
        """Every stored tensor's name."""
        return list(self._file_of)

    def model_safetensors(self) -> list[str] | None:
        """The full paths of a model's safetensors files and their index, which another reader (vLLM) can be given
        as they are; None for .bin files or a PEFT adapter's."""
        files = sorted(set(self._file_of.values()))
        if not all(f.endswith(".safetensors") for f in files) or files == ["adapter_model.safetensors"]:
            return None
        return [os.path.join(self.path, f) for f in [*files, *([self._index] if self._index else [])]]

    def _names_in(self, file: str) -> list[str]:
        handle = self._handle(file)
        return list(handle.keys())  # type: ignore[attr-defined]

    def shape(self, name: str) -> tuple[int, ...] | None:
        file = self._file_of.get(name)
        if file is None:
            return None
        handle = self._handle(file)
        if isinstance(handle, dict):
            return tuple(handle[name].shape)
        if isinstance(handle, SafetensorsReader):
            return handle.shape(name)
        return tuple(handle.get_slice(name).get_shape())  # type: ignore[attr-defined]

    def read(self, name: str, rows: Rows | None) -> torch.Tensor:
        handle = self._handle(self._file_of[name])
        if isinstance(handle, dict):
            t = handle[name]
            return t.clone() if rows is None else t[rows[0] : rows[1]].clone()
        if isinstance(handle, SafetensorsReader):
            return handle.read(name, rows)
        if rows is None:
            return handle.get_tensor(name)  # type: ignore[attr-defined]
        return handle.get_slice(name)[rows[0] : rows[1]]  # type: ignore[attr-defined]


def open_weights(path: str) -> FileWeights | None:
    """The directory's weights, None when they are in a form only `from_pretrained` reads (old pickled .bin)."""
    try:
        return FileWeights(path)
    except (RuntimeError, ValueError, OSError):  # torch.load(mmap=True) refuses the pre-1.6 pickle format
        return None


# ---- building without memory --------------------------------------------------------------------------------


@contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no init cost) and their buffers
    real: rotary frequencies and the like are computed, not stored in checkpoints, so they must survive."""
    register = nn.Module.register_parameter

    def on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:  # named as the method it replaces
        register(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def missing(model: nn.Module, weights: WeightSource) -> list[str]:
    """The model's parameters (tied ones once) that `weights` lacks or holds in another shape."""
    return [name for name, p in model.named_parameters() if weights.shape(name) != tuple(p.shape)]


M = TypeVar("M", bound=nn.Module, covariant=True, default=nn.Module)  # the model's class, when a builder knows it


@dataclass
class Unfilled(Generic[M]):
    """A model whose parameters are on the meta device, and where its weights are. A strategy places it (whole or
    sharded) and then fills it (`fill`)."""

    model: M
    weights: WeightSource
    prefix: str = ""  # the weights' names are the model's parameter names after this prefix
    note: str | None = None  # why this model costs more to load than its shard (said once in the log)

    def fill_each(
        self, device: torch.device, dtype: torch.dtype, take: Callable[[nn.Parameter], None], *, read: bool = True
    ) -> M:
        """One parameter at a time: allocate it whole on `device` in `dtype`, read it (left uninitialised when not
        `read`: another rank's copy overwrites it), hand it to `take` (which may shrink it to a partition) before
        the next is allocated. Buffers move to `device`. Peak: the model as `take` leaves it plus one parameter."""
        for module in self.model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device.type != "meta":
                    module._buffers[name] = buffer.to(device)
        done: dict[int, nn.Parameter] = {}
        for module_name, module in self.model.named_modules():
            for name, meta in list(module._parameters.items()):
                if meta is None:
                    continue
                if id(meta) not in done:  # a tied parameter is allocated once and set in every slot
                    full = f"{module_name}.{name}" if module_name else name
                    key = full[len(self.prefix) :] if full.startswith(self.prefix) else full
                    param = nn.Parameter(
                        torch.empty(meta.shape, dtype=dtype, device=device), requires_grad=meta.requires_grad
                    )
                    if read:
                        with torch.no_grad():
                            read_whole(param, self.weights, key)
                    done[id(meta)] = param
                    module._parameters[name] = param
                    take(param)
                module._parameters[name] = done[id(meta)]
        return self.model

    def fill(
        self, device: torch.device, *, param_device: torch.device | None = None, read_into: ReadInto | None = None
    ) -> M:
        """Allocate the parameters (on `param_device`, default `device`) and read each from the weights with
        `read_into` (default: the whole tensor; a sharding strategy passes one that reads its rows only); the buffers
        built with the model move to `device`."""
        fill(
            self.model,
            self.weights,
            device,
            param_device=param_device,
            prefix=self.prefix,
            read_into=read_into or read_whole,
        )
        return self.model


ReadInto = Callable[[nn.Parameter, WeightSource, str], None]  # (parameter, source, name in the source)


def read_whole(param: nn.Parameter, weights: WeightSource, name: str) -> None:
    param.copy_(weights.read(name, None))


def fill(
    model: nn.Module,
    weights: WeightSource,
    device: torch.device,
    *,
    param_device: torch.device | None = None,
    prefix: str = "",
    read_into: ReadInto = read_whole,
) -> None:
    buffers = [
        (m, name, b)
        for m in model.modules()
        for name, b in m._buffers.items()
        if b is not None and b.device.type != "meta"
    ]
    slots = [(m, name, id(p)) for m in model.modules() for name, p in m._parameters.items() if p is not None]
    model.to_empty(device=param_device or device)
    for module, name, buffer in buffers:  # to_empty left them uninitialised
        module._buffers[name] = buffer.to(device)
    first: dict[int, nn.Parameter | None] = {}  # as _parameters (the slots hold parameters only)
    for module, name, key in slots:  # to_empty gave each slot its own tensor: tied weights (lm_head) tie again
        module._parameters[name] = first.setdefault(key, module._parameters[name])
    with torch.no_grad():
        for name, param in model.named_parameters():
            read_into(param, weights, name[len(prefix) :] if name.startswith(prefix) else name)


def state_dict_weights(model: nn.Module, names: Sequence[str] | None = None) -> MemoryWeights:
    """A built model's parameters as a weight source (the embedded tiny model)."""
    state = dict(model.named_parameters())
    return MemoryWeights({k: v.detach() for k, v in state.items() if names is None or k in names})
