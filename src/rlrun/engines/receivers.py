"""How an engine takes each weight sync: the bucket format both sides share (the parameters packed into a few large
byte buffers, planned once and the same on every rank from names, shapes and dtypes, each sent in chunks) and the one
interface an engine offers (`WeightReceiver`: it keeps the weights in a model, hands each bucket on, or loads each
gathered parameter), which rlrun.weight_sync drives."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

ALIGN = 16  # bytes: every tensor view into a bucket starts aligned for any dtype


@dataclass(frozen=True)
class BucketEntry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the bucket start
    nbytes: int


def pack_buckets(
    params: Iterable[tuple[str, torch.Size, torch.dtype]], bucket_bytes: int, together: Sequence[Sequence[str]] = ()
) -> list[list[BucketEntry]]:
    """Greedy, order-preserving packing of parameters into buckets of at most bucket_bytes (a parameter larger than
    a bucket gets a bucket of its own). Each group in `together` (names of one dtype) is placed at its first
    member's place, its members in the group's order and back to back (no alignment padding between them: one
    tensor can view them all), and is never split across buckets."""
    params = list(params)
    known = {name: (name, torch.Size(shape), dtype) for name, shape, dtype in params}
    group_of: dict[str, Sequence[str]] = {}
    for group in together:
        absent = [n for n in group if n not in known]
        if absent or len({known[n][2] for n in group}) != 1:
            raise ValueError(
                f"pack_buckets: a group to keep together names parameters that are absent ({absent}) "
                f"or of different dtypes: {list(group)}"
            )
        group_of.update((n, group) for n in group)
    units: list[list[tuple[str, torch.Size, torch.dtype]]] = []
    placed: set[str] = set()
    for name, _, _ in params:
        if name not in placed:
            members = group_of.get(name, (name,))
            units.append([known[n] for n in members])
            placed.update(members)
    buckets: list[list[BucketEntry]] = [[]]
    used = 0
    for unit in units:
        sizes = [shape.numel() * dtype.itemsize for _, shape, dtype in unit]
        if buckets[-1] and used + sum(sizes) > bucket_bytes:
            buckets.append([])
            used = 0
        for (name, shape, dtype), nbytes in zip(unit, sizes):
            buckets[-1].append(BucketEntry(name, tuple(shape), dtype, used, nbytes))
            used += nbytes
        used = -(-used // ALIGN) * ALIGN
    return [b for b in buckets if b]


def bucket_size(bucket: list[BucketEntry]) -> int:
    last = bucket[-1]
    return -(-(last.offset + last.nbytes) // ALIGN) * ALIGN


def entry_view(buffer: torch.Tensor, e: BucketEntry) -> torch.Tensor:
    return buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape)


def chunk_bounds(bucket: list[BucketEntry], chunk_bytes: int) -> list[tuple[int, int, int]]:
    """Split a bucket into wire chunks at entry boundaries: (start byte, end byte, entries up to and
    including index) per chunk, each about chunk_bytes (an entry larger than that is one chunk). The
    chunks tile [0, bucket_size(bucket)) exactly, so a receiver can take them into its bucket buffer. A chunk
    never ends inside a group that pack_buckets kept together (its members are not aligned apart)."""
    chunks: list[tuple[int, int, int]] = []
    start = 0
    for i, e in enumerate(bucket):
        end = -(-(e.offset + e.nbytes) // ALIGN) * ALIGN
        last = i == len(bucket) - 1
        if last or (end - start >= chunk_bytes and bucket[i + 1].offset >= end):
            chunks.append((start, end, i))
            start = end
    return chunks


class BucketSink(abc.ABC):
    """An engine rank that keeps no copy of the policy and hands each bucket on: as it arrives in one of the two
    staging buffers the weight sync receives into, to a file its vLLM workers read, or to its vLLM child through the
    buffers' shared memory. rlrun.engines.vllm implements it; the weight sync only calls it."""

    model: nn.Module  # the policy on the meta device: the parameters' names and shapes, checked against the actor's

    @abc.abstractmethod
    def start(self, buckets: list[list[BucketEntry]], buffers: list[torch.Tensor]) -> None:
        """A sync begins: `buffers` (the same two for every sync) will hold bucket k in buffers[k % 2]."""

    @abc.abstractmethod
    def take(self, index: int) -> None:
        """Bucket `index` has arrived in its buffer (its views: entry_view); the sink may read it until release."""

    @abc.abstractmethod
    def release(self, index: int) -> None:
        """Return once bucket `index`'s buffer may be written again (the sink has read or copied it)."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Every bucket taken: return once the engine serves the new weights."""


class ParamLoader(abc.ABC):
    """An engine rank on the actor's ranks that keeps no copy of the policy (vLLM in this process): each sync, it
    takes every parameter as a new full tensor while the actor is gathered."""

    @abc.abstractmethod
    def load(self, named: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Take up every (name, full tensor) of a sync, in the actor's gather order; each tensor is new, the
        loader's to keep as long as it needs. Must iterate to the end: the iteration runs the actor's all-gathers."""


@dataclass(frozen=True)
class KeptModel:
    """An engine that keeps the weights in its own model's parameters (HF generate, rlrun's native engine): on the
    actor's ranks each parameter is written in place as it is gathered; elsewhere the parameters become views into
    the buckets, which receive each sync with nothing to unpack."""

    model: nn.Module


@dataclass(frozen=True)
class KeptAdapters:
    """An engine that keeps its base weights and runs a LoRA policy's adapters beside them (rlrun's native decoder):
    each sync sends the adapters alone. `adopt` makes the engine's adapter tensors for the actor's adapters ([name,
    shape] pairs, the names under the base model's modules) and returns the module holding them, which the sync then
    keeps as a KeptModel's model."""

    adopt: Callable[[list[tuple[str, list[int]]]], nn.Module]

    def kept(self, shapes: Iterable[tuple[str, Sequence[int]]]) -> KeptModel:
        return KeptModel(self.adopt([(name, list(shape)) for name, shape in shapes]))


def adapter_module(shapes: Sequence[tuple[str, Sequence[int]]], dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The module an engine keeps a LoRA policy's adapters in (KeptAdapters.adopt): its named_parameters are exactly
    `shapes` (zeros, no grad), the dotted names as nested submodules."""
    root = nn.Module()
    for name, shape in shapes:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.zeros(tuple(shape), dtype=dtype, device=device), False))
    return root


# How an engine rank takes each weight sync: the one weight interface of an engine
# (rlrun.engines.protocol.Engine.weights).
# It keeps the weights in a model, hands each bucket on, loads each parameter as it is gathered, or keeps its base
# weights and takes a LoRA policy's adapters.
WeightReceiver = KeptModel | BucketSink | ParamLoader | KeptAdapters
