"""How much of its GPU a vLLM engine asks for, given what this rank already holds there.

vLLM refuses to start when less than `gpu_memory_utilization x total` bytes of its GPU are free ("Free memory on
device ... on startup is less than desired GPU memory utilization"). The engines are built before a rank's
training models (rlrun.rl.build), and no engine rank keeps a copy of the policy (vllm_stream.py), but the GPU may be
shared: other ranks' processes on it, or another job's. So the share is fitted to what is free when the engine
starts, and the start-up log says so when it is lowered.
"""

from __future__ import annotations

import math

import torch

from rlrun.runtime.errors import ConfigError
from rlrun.runtime.log import get_logger

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
    where = (f"{free / GIB:.1f} of the {total / GIB:.1f} GiB of {device} are free ({held / GIB:.1f} GiB held by this "
             "rank; the rest by other processes on the GPU)")
    if fitted < MIN_UTILIZATION:
        raise ConfigError(f"vLLM engine: {where}, too little for vLLM's weights and KV cache next to them; give the "
                          "engines GPUs of their own (--vllm_num_engines on ranks without training models) or a "
                          "larger --vllm_tensor_parallel_size")
    if fitted < requested:
        get_logger(rank).info_once(f"--vllm_gpu_memory_utilization {requested:.2f}: vLLM would refuse to start, "
                                   f"{where}; vLLM gets {fitted:.2f} of the GPU")
    return fitted
