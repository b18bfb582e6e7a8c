"""The one place a generation backend is chosen by name: which backend a run uses (`resolve_backend`), what
planning may ask of each before any is built (the native decoder's `native_blocker`, vLLM's placement), and this
rank's engine (`build_engine`).

A backend is a module (hf.py) or a folder (native/, vllm/) of this package, reached from outside only through this
module; a new one (SGLang next) is a folder beside vllm/ and a branch here, plus its settings in GenerationConfig
(tests/test_package_layout.py checks that nothing else imports a backend). Every engine offers the same surface
(rlrun.engines.protocol.Engine): sampling, and the weights weight sync hands it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import torch
from transformers import PreTrainedTokenizerBase

from rlrun.config.generation import GenerationConfig
from rlrun.config.model import PretrainedConfig
from rlrun.engines.hf import HFEngine
from rlrun.engines.native.decoder import ADAPTABLE, fused_groups, unsupported_reason
from rlrun.engines.native.engine import NativeEngine
from rlrun.engines.protocol import Engine, SamplingSettings, TorchEngine
from rlrun.engines.vllm.adapter import CPU_KV_CACHE_GIB
from rlrun.engines.vllm.lora import VLLM_LORA_RANKS
from rlrun.engines.vllm.placement import choose_host, whole_world_problem
from rlrun.engines.vllm.placement import describe as describe_host
from rlrun.launch.context import RankContext
from rlrun.launch.dist import before_teardown, world_size
from rlrun.launch.layout import Layout, Role
from rlrun.launch.transfer import EngineRowExchange
from rlrun.models.adapter_pretrain import AdapterMerged, lora_settings
from rlrun.models.architecture import is_vision_language
from rlrun.models.loading import load_model_config
from rlrun.models.lora import LoraSettings
from rlrun.models.moe import config_routing_shape
from rlrun.models.weights import FileWeights, Unfilled
from rlrun.runtime.errors import ConfigError
from rlrun.runtime.log import get_logger

if TYPE_CHECKING:
    from rlrun.engines.vllm.engine import TensorParallelEngine, VLLMEngine
    from rlrun.engines.vllm.in_process import InProcessEngine


# What the rest of rlrun reads of the backends besides building an engine: the native decoder's fused weight groups
# (weight sync keeps them back to back) and what it cannot run; where a vLLM engine runs and what it holds on CPU
# (planning and the memory plan).
__all__ = [
    "CPU_KV_CACHE_GIB",
    "EngineImages",
    "build_engine",
    "choose_host",
    "describe_host",
    "engine_dtype",
    "fused_groups",
    "native_blocker",
    "resolve_backend",
    "whole_world_problem",
]


def native_blocker(config: object, max_len: int) -> str | None:
    """Why rlrun's native decoder cannot run a policy of this HF config at `max_len` tokens (None: it can)."""
    return unsupported_reason(config, max_len)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_backend(
    requested: str, cuda: bool, native_blocker: str | None = None
) -> tuple[Literal["native", "hf", "vllm"], str]:
    """(backend, why) for --generation_backend. `native_blocker`: why rlrun's decoder cannot run the policy
    (native_blocker), None when it can. `auto`: vLLM when it is installed (in the tested
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


def restarts_engines(g: GenerationConfig, layout: Layout) -> bool:
    """Whether this run's engines restart in place when they fail: vLLM children with --max_engine_restarts > 0
    (the backend resolved; the same answer on every rank)."""
    hosted = g.generation_backend == "vllm" and choose_host(g.vllm_engine_host, layout, len(layout.engines[0]))
    return hosted == "child" and g.max_engine_restarts > 0


def runs_adapters(
    backend: str, target_modules: Sequence[str], dense: bool, tensor_parallel_size: int, vision: bool
) -> bool:
    """Whether this run's engines run a LoRA policy's adapters beside their base weights, so that each weight sync
    sends the adapters alone: on a `dense` model (no MoE layer) with adapters on the projections rlrun's decoder runs
    (all-linear, or names among ADAPTABLE), the native decoder, and vLLM at tensor parallel 1 on a text policy (it
    loads each sync's adapters by name: engines/vllm/lora.py). Elsewhere (HF generate, a MoE, other targets,
    tensor-parallel vLLM, a vision-language policy on vLLM) the engines take the merged weights. The same answer on
    every rank (config alone)."""
    # a target is a module name or, as an adapter directory saved by rlrun lists them, a module's full path
    if not (dense and {t.rsplit(".", 1)[-1] for t in target_modules} <= {"all-linear", *ADAPTABLE}):
        return False
    return backend == "native" or (backend == "vllm" and tensor_parallel_size == 1 and not vision)


def engine_adapters(model: PretrainedConfig, g: GenerationConfig, tensor_parallel_size: int) -> LoraSettings | None:
    """The LoRA adapters this run's engines run beside their base weights (runs_adapters), or None: the run trains
    no adapters, or its engines take the merged weights. Reads the model's config.json for a LoRA run only."""
    lora = lora_settings(model)
    if lora is None:
        return None
    config = load_model_config(model)
    dense = config_routing_shape(config) is None
    vision = is_vision_language(config)
    runs = runs_adapters(g.generation_backend, lora.target_modules, dense, tensor_parallel_size, vision)
    too_wide = g.generation_backend == "vllm" and lora.rank > VLLM_LORA_RANKS[-1]  # vLLM's largest max_lora_rank
    return lora if runs and not too_wide else None


def engine_dtype(bf16: bool, device: torch.device) -> torch.dtype:
    """The dtype engines hold the policy in (and weight sync sends it in): bf16 on a GPU when asked, else fp32."""
    return torch.bfloat16 if bf16 and device.type == "cuda" else torch.float32


def sampling_settings(
    g: GenerationConfig, tokenizer: PreTrainedTokenizerBase, end_ids: tuple[int, ...]
) -> SamplingSettings:
    return SamplingSettings(g.temperature, g.top_p, g.generate_max_len, int(tokenizer.pad_token_id), end_ids)


@dataclass(frozen=True)
class EngineImages:
    """A vision-language policy's: its image processor, and the most images one prompt may hold (vLLM's limit)."""

    processor: Any
    per_prompt: int = 1


def build_engine(
    ctx: RankContext,
    g: GenerationConfig,
    unfilled: Unfilled,
    end_ids: tuple[int, ...],
    *,
    timeout_s: float,
    images: EngineImages | None = None,
    record_routing: bool = False,
    adapters: LoraSettings | None = None,
) -> Engine:
    """This engine rank's engine over `unfilled` (the initial policy on the meta device, in the engines' dtype),
    for --generation_backend (already resolved from auto, rlrun.plan.plan). `images`: a vision-language policy's,
    None for a text policy. `end_ids`: the ids that end a response (rlrun.models.loading). `record_routing`: report
    each token's MoE experts (--router_replay R3; the native and HF backends). `adapters`: a LoRA policy's, which the
    engine runs beside its base weights (engine_adapters; None: it takes the merged weights each sync)."""
    sampling = sampling_settings(g, ctx.tokenizer, end_ids)
    if adapters is not None:
        unfilled = base_alone(unfilled)
    if g.generation_backend == "vllm":
        return _vllm_engine(ctx, g, unfilled, sampling, timeout_s, images, adapters)
    device, tokenizer = ctx.device, ctx.tokenizer
    if g.generation_backend == "native":  # planning resolved `auto` and checked the architecture
        budget = None if g.native_kv_cache_mb is None else g.native_kv_cache_mb * 2**20
        native = NativeEngine(
            unfilled.fill(device), sampling, device, tokenizer, kv_cache_bytes=budget, cuda_graph=g.native_cuda_graph
        )
        if adapters is not None:
            native.run_adapters(adapters.scaling)
        engine: TorchEngine = native
    else:
        engine = HFEngine(unfilled.fill(device), sampling, device, tokenizer)
    engine.record_routing = record_routing
    return engine


def base_alone(unfilled: Unfilled) -> Unfilled:
    """An engine that runs the adapters beside its base weights starts from the base alone: an adapter directory as
    --pretrain reads as base + adapter merged (the frozen copies' start), to which every sync's adapters would be
    added a second time. The trainer's first sync (before any generation) gives the engine the saved adapters."""
    if isinstance(unfilled.weights, AdapterMerged):
        return replace(unfilled, weights=unfilled.weights.base)
    return unfilled


def _base_files(unfilled: Unfilled) -> tuple[str, ...]:
    """The model's own safetensors files and index when its weights are exactly them (names unprefixed), else ()."""
    weights = unfilled.weights
    files = weights.model_safetensors() if isinstance(weights, FileWeights) and not unfilled.prefix else None
    return tuple(files or ())


def _vllm_engine(
    ctx: RankContext,
    g: GenerationConfig,
    unfilled: Unfilled,
    sampling: SamplingSettings,
    timeout_s: float,
    images: EngineImages | None,
    adapters: LoraSettings | None,
) -> VLLMEngine | TensorParallelEngine | InProcessEngine:
    """vLLM in this rank when the engine ranks are the whole world (engines/vllm/placement.py); otherwise a vLLM
    child on this rank (tensor parallel 1), or this rank's part of a tensor-parallel engine whose child runs on the
    engine's first rank. Weight sync hands each sync to vLLM and the rank reads nothing (but a vision-language policy,
    or a LoRA policy's base weights, for vLLM's first file, into host memory and dropped once written)."""
    from rlrun.engines.vllm.engine import TensorParallelEngine, VLLMEngine, VLLMOptions  # noqa: PLC0415 - optional

    layout, rank, device, tokenizer = ctx.layout, ctx.rank, ctx.device, ctx.tokenizer
    index = layout.engine_index_of(rank)
    assert index is not None
    tp = len(layout.engines[index])  # the layout's engines are --vllm_tensor_parallel_size ranks each
    engine_group = ctx.groups.get(f"engine.{index}")
    assert engine_group is not None
    exchange = EngineRowExchange(engine_group, device)
    if g.vllm_enable_sleep and device.type != "cuda" and rank == layout.ranks_of(Role.ENGINE)[0]:
        get_logger(rank)._emit(
            "info", "--vllm_enable_sleep: no effect on CPU (vLLM has no sleep mode there); the engines stay awake"
        )  # from the engines' first rank, which need not be 0
    in_process = choose_host(g.vllm_engine_host, layout, tp) == "in_process"
    # Weight sync hands every sync straight to vLLM (the gathered tensors in-process, a stream of buckets to a child):
    # the rank keeps no copy of the policy. A vision-language policy is read for vLLM's first file, and dropped.
    # A LoRA policy's base weights: vLLM reads the pretrained safetensors files as they are, where they are those
    base_files = _base_files(unfilled) if adapters is not None else ()
    if (images is not None or (adapters is not None and not base_files)) and (in_process or exchange.is_leader):
        policy = unfilled.fill(torch.device("cpu"))
    else:
        policy = unfilled.model
    options = VLLMOptions.of(g, rank=rank, seed=ctx.seed, tensor_parallel_size=tp, timeout_s=timeout_s)
    if images is not None:
        options = replace(options, image_processor=images.processor, images_per_prompt=max(1, images.per_prompt))
    options = replace(options, lora=adapters, base_files=base_files)
    if in_process:
        from rlrun.engines.vllm.in_process import InProcessEngine  # noqa: PLC0415

        engine = InProcessEngine(
            policy, tokenizer, sampling, device, options, layout=layout, world_size=world_size(), exchange=exchange
        )
        before_teardown(engine.close)  # vLLM's groups go before the default group
        return engine
    leader = VLLMEngine(policy, tokenizer, sampling, device, options) if exchange.is_leader else None
    if tp == 1:
        assert leader is not None
        return leader
    return TensorParallelEngine(policy, sampling, exchange, leader)
