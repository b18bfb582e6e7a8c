"""How much of its GPU a vLLM engine asks for, given what this rank already holds there.

vLLM refuses to start when less than `gpu_memory_utilization x total` bytes of its GPU are free ("Free memory on
device ... on startup is less than desired GPU memory utilization"). An rlrun engine rank that shares the actor's
ranks holds a copy of the policy on that GPU before vLLM starts: the tensors weight sync writes into, which are
handed to vLLM after each sync (a 7B bf16 policy: 14 GiB), besides the actor's own. At OpenRLHF's usual 0.9-0.95
vLLM would then refuse to start on any model much above 3B. So the share is fitted to what is free when the engine
starts, and the start-up log says so when it is lowered. (An engine on ranks of its own keeps no copy:
vllm_stream.py.)
"""

from __future__ import annotations

import math

import torch

from rlrun.runtime.errors import ConfigError
from rlrun.runtime.log import get_logger

GIB = 2**30
# What vLLM's start must leave free besides its share: a child process's own CUDA context (~0.5 GiB), and what this
# rank allocates while vLLM starts beside it (weight sync binds its receive buffers one bucket, <= 256 MiB, at a time;
# a streaming engine allocates its two staging buffers).
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
             "rank: the policy copy that weight sync writes into, or its two staging buffers)")
    if fitted < MIN_UTILIZATION:
        raise ConfigError(f"vLLM engine: {where}, too little for vLLM's weights and KV cache next to them; give the "
                          "engines GPUs of their own (--vllm_num_engines on ranks without training models) or a "
                          "larger --vllm_tensor_parallel_size")
    if fitted < requested:
        get_logger(rank).info_once(f"--vllm_gpu_memory_utilization {requested:.2f}: vLLM would refuse to start, "
                                   f"{where}; vLLM gets {fitted:.2f} of the GPU")
    return fitted
