"""The runtime section (every trainer): device, process groups, timeouts, and the preflight's switches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlrun.config.fields import opt, positive


@dataclass
class RuntimeConfig:
    """Process groups and devices (rlrun's own)."""

    device: Literal["auto", "cpu", "cuda"] = opt("auto", "auto: cuda when available, else cpu.")
    dist_backend: Literal["auto", "nccl", "gloo"] = opt("auto", "auto: nccl with cuda, else gloo.")
    dist_timeout: float = opt(300.0, "Seconds any collective may wait before the job fails.")
    tf32: bool = opt(
        True,
        "GPU: fp32 matmuls and convolutions on TF32 tensor cores (Ampere and newer: several times "
        "faster, ~1e-3 relative error; PyTorch's own default for convolutions). false: exact fp32 "
        "matmuls. No effect on CPU or on bf16 math.",
    )
    data_timeout: float = opt(
        1800.0,
        "Seconds loading the datasets may take (every rank loads them before the first "
        "collective); past it the run fails naming the dataset.",
    )
    dry_run: bool = opt(
        False,
        "Preflight, then exit: print the role layout and its memory plan, read the prompt data "
        "and render its first prompt, import the reward source; loads no model weights, contacts no "
        "server.",
    )
    gpu_memory_gb: float | None = opt(
        None,
        "Per-GPU memory in GiB that --dry_run's memory plan checks every rank "
        "against "
        "(given, the plan is for GPUs even on a machine without one). Unset: the GPU's "
        "here (detected); none here: a CPU run's plan, or 80 with --device cuda.",
    )
    plan_json: str | None = opt(
        None,
        "--dry_run: also write the memory plan (per rank: GPU and host bytes by "
        "component; "
        "what does not fit and what would) to this JSON file.",
        metavar="PATH",
    )

    def check(self) -> None:
        positive("dist_timeout", self.dist_timeout)
        positive("data_timeout", self.data_timeout)
        positive("gpu_memory_gb", self.gpu_memory_gb, allow_none=True)
