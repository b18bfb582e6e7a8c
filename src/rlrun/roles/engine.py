"""Engine: rollout generation. Backend `hf` (transformers generate) runs everywhere; `vllm` is a
later backend behind the same two methods."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from rlrun.errors import ConfigError, MissingExtraError


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float
    top_p: float
    max_new_tokens: int
    pad_id: int
    eos_id: int


class Engine(Protocol):
    model: nn.Module

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """Prompt token ids -> response token ids (EOS included when it was sampled)."""
        ...


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_backend(requested: str, cuda: bool) -> tuple[str, str]:
    """(backend, why) for --generation_backend. Only `hf` is implemented in this release: the vLLM
    backend is a later issue, so asking for it is an error rather than a silent fallback."""
    if requested == "vllm":
        if not vllm_available():
            raise MissingExtraError("vllm", "vllm", "--generation_backend vllm")
        raise ConfigError("--generation_backend vllm: the vLLM engine backend is not implemented in this rlrun "
                          "release yet; use --generation_backend hf (or auto)")
    if requested == "hf":
        return "hf", "requested"
    if cuda and vllm_available():
        return "hf", "auto: vLLM is installed but rlrun's vLLM backend is not implemented yet"
    return "hf", "auto: " + ("vLLM is not installed" if cuda else "no GPU")


class HFEngine:
    """Sampling with transformers `generate`: left-padded prompts, stop at EOS."""

    def __init__(self, model: nn.Module, sampling: SamplingSettings, device: torch.device) -> None:
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.sampling = sampling
        self.device = device

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        s = self.sampling
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), s.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        # Sampling draws from the global RNG; a seed per (step, rank) makes rollouts reproducible
        # and resumable without saving generator state.
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), do_sample=True,
                temperature=s.temperature, top_p=s.top_p, top_k=0, max_new_tokens=s.max_new_tokens,
                pad_token_id=s.pad_id, eos_token_id=s.eos_id,
            )
        responses = []
        for row in out[:, width:].tolist():
            if s.eos_id in row:
                row = row[: row.index(s.eos_id) + 1]
            responses.append(row)
        return responses
