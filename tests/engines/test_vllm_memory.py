"""The GPU share a vLLM engine asks for, fitted to what its rank already holds there (rlrun.engines.vllm.placement).
vLLM 0.32 refuses to start when less than utilization x total bytes are free (vllm/v1/worker/utils.py); the CUDA
call site runs only on a GPU, so these check the arithmetic with hand-computed numbers and that other devices pass
the flag through."""

from __future__ import annotations

import torch

from rlrun.engines.vllm.placement import GIB, START_RESERVE, fitted_utilization, gpu_utilization


def test_the_share_is_what_is_free_less_the_reserve_never_more_than_asked():
    total = 80 * GIB
    # 14 GiB held by another process on the GPU and a CUDA context (0.5 GiB): 65.5 GiB free
    free = total - 14 * GIB - GIB // 2
    assert START_RESERVE == 3 * GIB // 2
    assert fitted_utilization(0.9, free, total) == 0.8  # floor((65.5 - 1.5) / 80, 0.01) = 0.80
    assert fitted_utilization(0.95, free, total) == 0.8
    assert fitted_utilization(0.6, free, total) == 0.6  # fits as asked: unchanged
    # 1 GiB held: 0.9 fits
    assert fitted_utilization(0.9, total - GIB - GIB // 2, total) == 0.9
    # free 58.4 of 64 GiB at 0.92 (a failure vLLM reports): 58.4 - 1.5 = 56.9 GiB = 0.889 x 64 -> 0.88
    assert fitted_utilization(0.92, int(58.4 * GIB), 64 * GIB) == 0.88
    assert fitted_utilization(0.9, GIB, total) < 0  # nothing fits: the caller refuses


def test_other_devices_keep_the_flag():
    assert gpu_utilization(0.95, torch.device("cpu"), rank=0) == 0.95
