"""The generation engine's surface: what the RL step, the rollouts, evaluation and the agents ask of any backend.

An engine samples (`Engine.sample`: token ids in, the sampled ids and their log-probabilities out) and takes the
actor's weights each sync (`Engine.weights`, rlrun.weight_sync.buckets). Backends: HF generate (rlrun.engines.hf),
rlrun's KV-cache decoder (rlrun.engines.native), vLLM (rlrun.engines.vllm); each is reached only through
rlrun.engines.build, the one place a backend is chosen by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from rlrun.data.vision_batch import RowVision
from rlrun.engines.receivers import KeptModel, WeightReceiver

# ---- stop strings ------------------------------------------------------------------------------------------------
# Where a turn ends: the first token that completes a stop string (that token kept).


def cut_at_stop(tokens: list[int], stop: tuple[str, ...], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """tokens[:k] for the smallest k whose text contains a stop string; all of tokens when none does.

    Token-level, never re-tokenised: the kept ids are exactly the sampled ones, so the actor's log-probs
    stay those of the engine's samples. (Search-R1 cuts the decoded text and re-tokenises it, which can
    change the ids; rlrun does not.) Binary search: containing a stop string is monotone in k."""
    if not stop or not tokens:
        return tokens

    def contains(k: int) -> bool:
        text = tokenizer.decode(tokens[:k], skip_special_tokens=False)
        return any(s in text for s in stop)

    if not contains(len(tokens)):
        return tokens
    lo, hi = 1, len(tokens)  # invariant: contains(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        if contains(mid):
            hi = mid
        else:
            lo = mid + 1
    return tokens[:hi]


# The backends whose engines return each sampled token's log-probability (Generation.log_probs).
REPORTS_LOG_PROBS = frozenset({"native", "vllm"})


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float
    top_p: float
    max_new_tokens: int
    pad_id: int
    end_ids: tuple[int, ...]  # the ids that end a response (rlrun.models.loading.response_end_ids)


@dataclass
class Generation:
    """responses[i]: response token ids of prompt i (EOS included when sampled); log_probs[i]: the
    engine's log-probability of each of those tokens as sampled (after temperature / top-p), or None
    when the backend does not report them (HF: its scores would cost batch x length x vocab memory); routing[i]: the
    experts each of prompt i's and its response's tokens went through, [prompt + response tokens, layers, k] uint8
    (rlrun.models.moe; --router_replay R3 on a MoE policy), else None."""

    responses: list[list[int]]
    log_probs: list[list[float]] | None = None
    routing: list[torch.Tensor] | None = None


class Engine(Protocol):
    """A generation engine: it samples responses, and takes the actor's weights each sync."""

    # How this rank takes each weight sync (rlrun.weight_sync.buckets: it keeps the weights in a model, hands each
    # bucket on, or loads each gathered parameter); None on an engine's ranks that its first rank takes them for.
    weights: WeightReceiver | None
    sampling: SamplingSettings  # read on every call (evaluation swaps it for its own temperature)

    @property
    def restarts(self) -> int:
        """Times this rank's engine was restarted in place after it failed (a vLLM child: --max_engine_restarts)."""
        ...

    def sample(
        self,
        prompts: list[list[int]],
        seed: int,
        *,
        max_new_tokens: int | None = None,
        stop: tuple[str, ...] = (),
        vision: RowVision | None = None,
        keys: list[int] | None = None,
    ) -> Generation:
        """Prompt token ids -> each prompt's response ids (EOS included when it was sampled) and, where the backend
        reports them, the sampled tokens' log-probabilities. max_new_tokens: this call's cap (default the settings');
        stop: strings that end a response early (multi-turn agents): a response ends at the first token that
        completes one, that token included (cut_at_stop). vision: the rows' images, for the backends that run
        vision-language policies (HF, vLLM); a text-only backend refuses them (planning refuses the pairing first).
        keys: each row's draw key (default: its place in the call): with the native engine, and vLLM with
        --vllm_seeded_requests, a row's sample is a function of (seed, key) whatever else the call holds, so rows
        whose calls are batched by timing (the gateway's) sample the same in every run; HF ignores them."""
        ...

    def load_weights(self) -> None:
        """Take up the weights of the sync that just ended (called once after every sync)."""
        ...


def refuse_images(vision: RowVision | None, backend: str) -> None:
    """A text-only backend's answer to images (planning refuses a vision-language policy on it before any is built)."""
    if vision is not None:
        raise ValueError(f"the {backend} engine samples text policies only; it was handed prompt images")


@runtime_checkable
class SamplesUntil(Protocol):
    """An engine that can stop a call once enough prompt groups have finished (rlrun's native decoder):
    --partial_rollout then ends its decode right where the step is full."""

    def sample_until(
        self, prompts: list[list[int]], seed: int, limits: list[int], groups: list[int], need: int
    ) -> tuple[Generation, list[bool]]: ...


class TorchEngine:
    """What the engines that run the policy with plain torch in this process share (HF generate, native; not vLLM):
    a frozen model in eval mode that weight sync writes into, the sampling settings, generate() over sample()."""

    def __init__(
        self,
        model: nn.Module,
        sampling: SamplingSettings,
        device: torch.device,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        self.tokenizer = tokenizer  # needed for stop strings only
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.weights: WeightReceiver | None = KeptModel(self.model)  # weight sync writes into the model
        self.sampling = sampling
        self.device = device
        # --router_replay R3: sample() reports each token's experts (Generation.routing; a MoE policy)
        self.record_routing = False

    @property
    def restarts(self) -> int:
        """Never: the engine runs in the rank's own process (its failure is the rank's)."""
        return 0

    def sample(
        self,
        prompts: list[list[int]],
        seed: int,
        *,
        max_new_tokens: int | None = None,
        stop: tuple[str, ...] = (),
        vision: RowVision | None = None,
        keys: list[int] | None = None,
    ) -> Generation:
        raise NotImplementedError  # each backend's

    def load_weights(self) -> None:
        """Nothing to do: each call reads `model` as it is, and weight sync writes into it."""
