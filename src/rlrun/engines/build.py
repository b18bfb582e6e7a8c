"""This rank's generation engine, built from the generation settings: the one place a backend is chosen by name.

A backend is a module (native.py, base.py's HFEngine) or a folder (vllm/) of this package, and one branch of
`build_engine`; a new one (SGLang next) is a folder beside vllm/ and a branch here, plus its settings in
GenerationConfig. Every engine offers the same surface (rlrun.engines.base.Engine): sampling, and the weights
weight sync hands it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from rlrun.config.generation import GenerationConfig
from rlrun.engines.base import Engine, HFEngine, SamplingSettings, TorchEngine
from rlrun.engines.native import NativeEngine
from rlrun.launch.dist import before_teardown, world_size
from rlrun.launch.groups import Groups
from rlrun.launch.layout import Layout, Role
from rlrun.launch.transfer import EngineRowExchange
from rlrun.models.weights import Unfilled
from rlrun.runtime.log import get_logger

if TYPE_CHECKING:
    from rlrun.engines.vllm.engine import TensorParallelEngine, VLLMEngine
    from rlrun.engines.vllm.in_process import InProcessEngine


def engine_dtype(bf16: bool, device: torch.device) -> torch.dtype:
    """The dtype engines hold the policy in (and weight sync sends it in): bf16 on a GPU when asked, else fp32."""
    return torch.bfloat16 if bf16 and device.type == "cuda" else torch.float32


def sampling_settings(
    g: GenerationConfig, tokenizer: PreTrainedTokenizerBase, end_ids: tuple[int, ...]
) -> SamplingSettings:
    return SamplingSettings(g.temperature, g.top_p, g.generate_max_len, int(tokenizer.pad_token_id), end_ids)


def build_engine(
    g: GenerationConfig,
    unfilled: Unfilled,
    tokenizer: PreTrainedTokenizerBase,
    end_ids: tuple[int, ...],
    *,
    layout: Layout,
    groups: Groups,
    device: torch.device,
    seed: int,
    tensor_parallel_size: int,
    timeout_s: float,
    image_processor: Any = None,
    images_per_prompt: int = 0,
    record_routing: bool = False,
) -> Engine:
    """This engine rank's engine over `unfilled` (the initial policy on the meta device, in the engines' dtype),
    for --generation_backend (already resolved from auto, rlrun.plan.plan). `image_processor`: a vision-language
    policy's, None for a text policy. `end_ids`: the ids that end a response (rlrun.models.loading).
    `record_routing`: report each token's MoE experts (--router_replay R3; the native and HF backends)."""
    sampling = sampling_settings(g, tokenizer, end_ids)
    if g.generation_backend == "vllm":
        return _vllm_engine(
            g,
            unfilled,
            tokenizer,
            sampling,
            layout=layout,
            groups=groups,
            device=device,
            seed=seed,
            tp=tensor_parallel_size,
            timeout_s=timeout_s,
            image_processor=image_processor,
            images_per_prompt=images_per_prompt,
        )
    if g.generation_backend == "native":  # planning resolved `auto` and checked the architecture
        budget = None if g.native_kv_cache_mb is None else g.native_kv_cache_mb * 2**20
        engine: TorchEngine = NativeEngine(
            unfilled.fill(device), sampling, device, tokenizer, kv_cache_bytes=budget, cuda_graph=g.native_cuda_graph
        )
    else:
        engine = HFEngine(unfilled.fill(device), sampling, device, tokenizer)
    engine.record_routing = record_routing
    return engine


def _vllm_engine(
    g: GenerationConfig,
    unfilled: Unfilled,
    tokenizer: PreTrainedTokenizerBase,
    sampling: SamplingSettings,
    *,
    layout: Layout,
    groups: Groups,
    device: torch.device,
    seed: int,
    tp: int,
    timeout_s: float,
    image_processor: Any,
    images_per_prompt: int,
) -> VLLMEngine | TensorParallelEngine | InProcessEngine:
    """vLLM in this rank when the engine ranks are the whole world (engines/vllm/placement.py); otherwise a vLLM
    child on this rank (tensor parallel 1), or this rank's part of a tensor-parallel engine whose child runs on the
    engine's first rank. Weight sync hands each sync to vLLM and the rank reads nothing (but a vision-language policy,
    for vLLM's first file, into host memory and dropped once written)."""
    from rlrun.engines.vllm.engine import TensorParallelEngine, VLLMEngine  # noqa: PLC0415 - optional extra
    from rlrun.engines.vllm.placement import choose_host  # noqa: PLC0415

    rank = groups.rank
    index = layout.engine_index_of(rank)
    assert index is not None
    engine_group = groups.get(f"engine.{index}")
    assert engine_group is not None
    exchange = EngineRowExchange(engine_group, device)
    max_model_len = g.prompt_max_len + g.generate_max_len
    if g.vllm_enable_sleep and device.type != "cuda" and rank == layout.ranks_of(Role.ENGINE)[0]:
        get_logger(rank)._emit(
            "info", "--vllm_enable_sleep: no effect on CPU (vLLM has no sleep mode there); the engines stay awake"
        )  # from the engines' first rank, which need not be 0
    in_process = choose_host(g.vllm_engine_host, layout, tp) == "in_process"
    # Weight sync hands every sync straight to vLLM (the gathered tensors in-process, a stream of buckets to a child):
    # the rank keeps no copy of the policy. A vision-language policy is read for vLLM's first file, and dropped.
    if image_processor is not None and (in_process or exchange.is_leader):
        policy = unfilled.fill(torch.device("cpu"))
    else:
        policy = unfilled.model
    images = (
        {}
        if image_processor is None
        else {"image_processor": image_processor, "images_per_prompt": max(1, images_per_prompt)}
    )
    if in_process:
        from rlrun.engines.vllm.in_process import InProcessEngine  # noqa: PLC0415

        engine = InProcessEngine(
            policy,
            tokenizer,
            sampling,
            device,
            layout=layout,
            world_size=world_size(),
            rank=rank,
            exchange=exchange,
            seed=seed,
            max_model_len=max_model_len,
            tensor_parallel_size=tp,
            enforce_eager=g.enforce_eager,
            gpu_memory_utilization=g.vllm_gpu_memory_utilization,
            enable_sleep=g.vllm_enable_sleep,
            kv_cache_memory_bytes=g.vllm_kv_cache_memory_bytes,
            seeded_requests=g.vllm_seeded_requests,
            **images,
        )
        before_teardown(engine.close)  # vLLM's groups go before the default group
        return engine
    leader = None
    if exchange.is_leader:
        leader = VLLMEngine(
            policy,
            tokenizer,
            sampling,
            device,
            seed=seed,
            max_model_len=max_model_len,
            timeout_s=timeout_s,
            enforce_eager=g.enforce_eager,
            gpu_memory_utilization=g.vllm_gpu_memory_utilization,
            rank=rank,
            tensor_parallel_size=tp,
            enable_sleep=g.vllm_enable_sleep,
            kv_cache_memory_bytes=g.vllm_kv_cache_memory_bytes,
            seeded_requests=g.vllm_seeded_requests,
            **images,
        )
    if tp == 1:
        assert leader is not None
        return leader
    return TensorParallelEngine(policy, sampling, exchange, leader)
