"""A LoRA policy's adapters on a vLLM engine: vLLM keeps the base weights it loaded at start and each weight sync
sends the adapters alone (rlrun.engines.receivers.KeptAdapters). After a sync the engine rank writes them as a PEFT
directory and vLLM loads it under a new name and id (its caches, the prefix cache included, key by them: a version
loaded under an old one would not be read again); the sums of the tensors vLLM then holds are checked against the
ones sent, so an adapter that did not arrive whole is one error, never a silent sample from other weights."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from rlrun.engines.receivers import adapter_module
from rlrun.models.lora import PEFT_PREFIX, LoraSettings, saved_adapter_name

# vLLM 0.32's choices of max_lora_rank (vllm/config/lora.py MaxLoRARanks); an adapter of a smaller rank is padded.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds adapters of `rank`."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"vLLM runs LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}; this policy's are rank {rank}")
    return fits[0]


@dataclass(frozen=True)
class AdapterSums:
    """What identifies an adapter's values as vLLM holds them: sum(A) and scaling * sum(B) over every adapted module
    (vLLM scales B by alpha / rank as it loads), and the sum of their magnitudes (the tolerance's scale)."""

    a: float
    b: float
    magnitude: float

    def matches(self, other: AdapterSums, half: bool) -> bool:
        """Equal up to rounding: fp32 sums, or (`half`) values vLLM cast to bf16/fp16 (2^-8 relative each)."""
        tol = (2.0**-7 if half else 1e-5) * self.magnitude + 1e-6
        return abs(self.a - other.a) <= tol and abs(self.b - other.b) <= tol


def adapter_sums(pairs: Iterable[tuple[torch.Tensor | None, torch.Tensor | None]], b_scale: float) -> AdapterSums:
    """Sums over (A, B) pairs (None parts skipped: vLLM's packed modules hold None for a projection without one)."""
    a = b = magnitude = 0.0
    for lora_a, lora_b in pairs:
        if lora_a is not None:
            a += float(lora_a.double().sum())
            magnitude += float(lora_a.double().abs().sum())
        if lora_b is not None:
            b += float(lora_b.double().sum()) * b_scale
            magnitude += float(lora_b.double().abs().sum()) * abs(b_scale)
    return AdapterSums(a, b, magnitude)


@dataclass(frozen=True)
class AdapterVersion:
    """One sync's adapters on disk: vLLM's name and id for them (new each sync), their directory, and the sums vLLM
    must hold once it loaded them."""

    name: str
    lora_id: int
    path: str
    sums: AdapterSums


class AdapterFiles:
    """The engine rank's side: the module each sync writes the actor's adapters into (`adopt`, for KeptAdapters),
    and after each sync a new version directory under `root` (PEFT's adapter_config.json and
    adapter_model.safetensors). `loaded` records the version vLLM samples with (`current`: what a restarted vLLM
    child is given) and removes the one before it."""

    def __init__(self, settings: LoraSettings, root: str) -> None:
        self.settings = settings
        self.root = root
        self.module: nn.Module | None = None
        self.version = 0
        self.current: AdapterVersion | None = None  # the version vLLM samples with (None: the base weights)

    def adopt(self, shapes: list[tuple[str, list[int]]]) -> nn.Module:
        self.module = adapter_module(shapes, torch.float32, torch.device("cpu"))
        return self.module

    def next_version(self) -> AdapterVersion:
        """The adapters as the last sync left them, written as version n + 1."""
        from safetensors.torch import save_file  # noqa: PLC0415 - transformers' own dependency

        assert self.module is not None, "no weight sync has reached this engine yet"
        self.version += 1
        path = os.path.join(self.root, f"v{self.version}")
        os.makedirs(path, exist_ok=True)
        params = self.module.named_parameters()
        named = {PEFT_PREFIX + saved_adapter_name(n): p.detach().cpu().contiguous() for n, p in params}
        save_file(named, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
        self.settings.peft_config().save_pretrained(path)  # PEFT's own adapter_config.json
        pairs = [(p, named[n.replace(".lora_A.", ".lora_B.")]) for n, p in named.items() if ".lora_A." in n]
        sums = adapter_sums(pairs, self.settings.scaling)
        return AdapterVersion(f"rlrun-policy-v{self.version}", self.version, path, sums)

    def loaded(self, version: AdapterVersion) -> None:
        """vLLM samples with `version` from now on: it becomes `current`, and the one before it (which vLLM read when it
        loaded it; older ones went before) leaves the disk."""
        if self.current is not None:
            shutil.rmtree(self.current.path, ignore_errors=True)
        self.current = version
