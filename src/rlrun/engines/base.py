"""Engine: rollout generation. Backend `hf` (transformers generate) runs every model; `native` (rlrun.engines.native,
rlrun's own KV-cache decoder for Llama-family models) and `vllm` (rlrun.engines: in-process or a child process per
engine) sit behind the same surface."""

from __future__ import annotations

import importlib.util
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from rlrun.data.vision_batch import RowVision
from rlrun.models.moe import engine_routing, recorded_calls
from rlrun.runtime.errors import ConfigError
from rlrun.vision.inputs import generate_inputs
from rlrun.weight_sync.buckets import KeptModel, WeightReceiver

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

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        """Prompt token ids -> response token ids (EOS included when it was sampled)."""
        ...

    def sample(
        self, prompts: list[list[int]], seed: int, *, max_new_tokens: int | None = None, stop: tuple[str, ...] = ()
    ) -> Generation:
        """generate() plus the sampled tokens' log-probabilities. max_new_tokens: this call's cap (default the
        settings'); stop: strings that end a response early (multi-turn agents). A response ends at the first
        token that completes a stop string, that token included (rlrun.engines.base.cut_at_stop). Engines that
        run vision-language policies (HFEngine) also take `vision=`, the rows' images (rlrun.data.vision_batch)."""
        ...

    def load_weights(self) -> None:
        """Take up the weights of the sync that just ended (called once after every sync)."""
        ...


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_backend(
    requested: str, cuda: bool, native_blocker: str | None = None
) -> tuple[Literal["native", "hf", "vllm"], str]:
    """(backend, why) for --generation_backend. `native_blocker`: why rlrun's decoder cannot run the policy
    (rlrun.engines.decoder.unsupported_reason), None when it can. `auto`: vLLM when it is installed (in the tested
    range) and a GPU is present, as OpenRLHF users expect; else native when it can run the policy (on CPU faster
    than HF generate, and it reports log-probs); else HF."""
    if requested == "vllm":
        from rlrun.engines.vllm.adapter import check_version  # noqa: PLC0415 - no vllm import, metadata only

        version = check_version()
        return "vllm", f"requested: vLLM {version}" + (
            "; no sleep mode on CPU (sleep/wake do nothing)" if not cuda else ""
        )
    if requested == "hf":
        return "hf", "requested"
    if requested == "native":
        if native_blocker is not None:
            raise ConfigError(
                f"--generation_backend native cannot run this policy: {native_blocker}; use "
                "--generation_backend hf (or auto)"
            )
        return "native", "requested"
    vllm_note = ""
    if cuda and vllm_available():
        from rlrun.engines.vllm.adapter import SUPPORTED_TEXT, check_version, installed_version  # noqa: PLC0415

        try:
            version = check_version()
        except ConfigError:
            vllm_note = f"; vLLM {installed_version()} is installed but not used: rlrun supports {SUPPORTED_TEXT}"
        else:
            return "vllm", (
                f"auto: vLLM {version} is installed and a GPU is present (rlrun's vLLM path has not run on "
                "a GPU yet; --generation_backend native or hf avoids it)"
            )
    if native_blocker is not None:
        return "hf", f"auto: the native engine cannot run this policy ({native_blocker})" + vllm_note
    return "native", "auto: rlrun's KV-cache decoder runs this architecture" + vllm_note


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

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        return self.sample(prompts, seed).responses

    def sample(
        self, prompts: list[list[int]], seed: int, *, max_new_tokens: int | None = None, stop: tuple[str, ...] = ()
    ) -> Generation:
        raise NotImplementedError

    def load_weights(self) -> None:
        """Nothing to do: each call reads `model` as it is, and weight sync writes into it."""


class HFEngine(TorchEngine):
    """Sampling with transformers `generate`: left-padded prompts, stop at EOS."""

    @torch.no_grad()
    def sample(
        self,
        prompts: list[list[int]],
        seed: int,
        *,
        max_new_tokens: int | None = None,
        stop: tuple[str, ...] = (),
        vision: RowVision | None = None,
    ) -> Generation:
        s = self.sampling
        stop_kwargs: dict = {}
        if stop:
            if self.tokenizer is None:
                raise ValueError("HFEngine needs its tokenizer for stop strings")
            stop_kwargs = {"stop_strings": list(stop), "tokenizer": self.tokenizer}
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), s.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        images = {} if vision is None else generate_inputs(self.model, ids.to(self.device), vision)
        # Sampling draws from the global RNG; a seed per (step, rank) makes rollouts reproducible
        # and resumable without saving generator state.
        record: AbstractContextManager[list[torch.Tensor]] = (
            recorded_calls(self.model) if self.record_routing else nullcontext([])
        )
        with record as calls, torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = self.model.generate(  # type: ignore[operator]  # an HF model's method
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                do_sample=True,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=0,
                max_new_tokens=s.max_new_tokens if max_new_tokens is None else max_new_tokens,
                pad_token_id=s.pad_id,
                eos_token_id=list(s.end_ids),
                **stop_kwargs,
                **images,
            )
        responses = []
        for row in out[:, width:].tolist():
            end = next((i for i, token in enumerate(row) if token in s.end_ids), None)
            if end is not None:
                row = row[: end + 1]
            if stop:  # generate stops a row after its stop string but pads it; cut exactly there
                row = cut_at_stop(row, stop, self.tokenizer)  # type: ignore[arg-type]
            responses.append(row)
        if not self.record_routing:
            return Generation(responses)
        lens = [len(p) for p in prompts], [len(r) for r in responses]
        return Generation(responses, routing=engine_routing(calls, len(prompts), *lens))
