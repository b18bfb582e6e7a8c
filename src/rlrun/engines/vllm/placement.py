"""Where a vLLM engine runs: inside the rank (vLLM's `external_launcher`) or in a spawned child process.

vLLM's `external_launcher` builds its process groups over the WHOLE torch.distributed world: every rank must
build an `LLM` with the same configuration, and when only some ranks do, the others wait forever with no error
(measured, shared/VLLM.md D2). So the in-process host is chosen from the layout alone, and only when the engine
ranks are every rank of the world, in consecutive tensor-parallel blocks from rank 0 (vLLM's TP groups are
consecutive world ranks). Every other layout runs each engine in a child process with its own private world.

Why in-process is the default where it is possible (--vllm_engine_host auto): no second process per engine (no
second copy of vLLM's import, no shared-memory hand-over, and on a GPU no second CUDA context beside the actor's),
tensor parallel through vLLM's own workers-in-the-ranks instead of a child with T worker processes and weights
written to /dev/shm, and weights passed to vLLM by reference. `--vllm_engine_host child` keeps the child host
for those layouts too (for example to keep vLLM's side effects out of the trainer's processes).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from rlrun.launch.layout import Layout, Role
from rlrun.runtime.errors import ConfigError
from rlrun.runtime.log import get_logger

EngineHost = Literal["child", "in_process"]
HostRequest = Literal["auto", "child", "in_process"]


def whole_world_problem(layout: Layout, tensor_parallel_size: int) -> str | None:
    """Why the in-process host cannot serve this layout (None: it can)."""
    world = tuple(range(layout.world_size))
    engine = layout.ranks_of(Role.ENGINE)
    if engine != world:
        return (
            f"the engine ranks {list(engine)} are not the whole world of {layout.world_size} ranks (vLLM's "
            "external_launcher builds its groups over every rank and hangs when only some build an engine)"
        )
    blocks = tuple(tuple(range(i, i + tensor_parallel_size)) for i in range(0, layout.world_size, tensor_parallel_size))
    if layout.engines != blocks:
        return (
            f"the engines {[list(e) for e in layout.engines]} are not consecutive blocks of tensor parallel "
            f"{tensor_parallel_size} from rank 0, the groups vLLM builds"
        )
    return None


def choose_host(requested: HostRequest, layout: Layout, tensor_parallel_size: int) -> EngineHost:
    """The host for --generation_backend vllm (ConfigError when in_process is asked on a layout it cannot serve)."""
    problem = whole_world_problem(layout, tensor_parallel_size)
    if requested == "in_process" and problem is not None:
        raise ConfigError(
            f"--vllm_engine_host in_process: {problem}; use --colocate_all_models (every role and engine "
            "on every rank) or --vllm_engine_host child (or auto)"
        )
    if requested == "child":
        return "child"
    return "in_process" if problem is None else "child"


def describe(host: EngineHost, tensor_parallel_size: int) -> str:
    if host == "in_process":
        return f"in-process vLLM on every rank (external_launcher, tensor parallel {tensor_parallel_size})"
    return f"vLLM in a child process per engine (tensor parallel {tensor_parallel_size})"


# ---- GPU memory --------------------------------------------------------------------------------------------------
# How much of its GPU a vLLM engine asks for, given what this rank already holds there.
#
# vLLM refuses to start when less than `gpu_memory_utilization x total` bytes of its GPU are free ("Free memory on
# device ... on startup is less than desired GPU memory utilization"). The engines are built before a rank's
# training models (rlrun.rl.assembly), and no engine rank keeps a copy of the policy (rlrun.engines.vllm.stream), but
# the GPU may be
# shared: other ranks' processes on it, or another job's. So the share is fitted to what is free when the engine
# starts, and the start-up log says so when it is lowered.

GIB = 2**30
# What vLLM's start must leave free besides its share: a child process's own CUDA context (~0.5 GiB), and what this
# rank allocates while vLLM starts beside it (the rest of its start-up: its training models, weight sync's two staging
# buffers).
START_RESERVE = 3 * GIB // 2
# Below this share vLLM cannot hold a useful KV cache next to its weights on any GPU: refuse instead of a slow failure.
MIN_UTILIZATION = 0.05


def fitted_utilization(requested: float, free: int, total: int, reserve: int = START_RESERVE) -> float:
    """The share of the GPU (total bytes, free of them now) vLLM may ask for: `requested`, or less when that many
    bytes less `reserve` are not free, down to a multiple of 0.01."""
    return min(requested, math.floor((free - reserve) / total * 100) / 100)


def gpu_utilization(requested: float, device: torch.device, rank: int) -> float:
    """`requested` (--vllm_gpu_memory_utilization) fitted to the memory free on `device` now (CUDA only; other
    devices: unchanged). Says so once when it is lowered; ConfigError when under MIN_UTILIZATION would be left."""
    if device.type != "cuda":
        return requested
    torch.cuda.empty_cache()  # blocks this process's allocator holds unused are free for vLLM's count too
    free, total = torch.cuda.mem_get_info(device)
    fitted = fitted_utilization(requested, free, total)
    held = torch.cuda.memory_allocated(device)
    where = (
        f"{free / GIB:.1f} of the {total / GIB:.1f} GiB of {device} are free ({held / GIB:.1f} GiB held by this "
        "rank; the rest by other processes on the GPU)"
    )
    if fitted < MIN_UTILIZATION:
        raise ConfigError(
            f"vLLM engine: {where}, too little for vLLM's weights and KV cache next to them; give the "
            "engines GPUs of their own (--vllm_num_engines on ranks without training models) or a "
            "larger --vllm_tensor_parallel_size"
        )
    if fitted < requested:
        get_logger(rank).info_once(
            f"--vllm_gpu_memory_utilization {requested:.2f}: vLLM would refuse to start, "
            f"{where}; vLLM gets {fitted:.2f} of the GPU"
        )
    return fitted
