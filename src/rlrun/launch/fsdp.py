"""FSDP2 training strategy on a role's process group (the only sharding code).

Kept behind the small `Strategy` surface (wrap, clip_grad_norm, full_params, state dicts) so a
DeepSpeed strategy can sit next to it.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class FSDPStrategy:
    def __init__(self, group: dist.ProcessGroup, device: torch.device, *, bf16: bool, zero_stage: int,
                 offload: bool, gradient_checkpointing: bool) -> None:
        self.group = group
        self.device = device
        self.bf16 = bf16 and device.type == "cuda"  # bf16 compute on CPU is slow and not what users want there
        # ZeRO-3 frees gathered parameters after forward; ZeRO-2 keeps them until backward.
        self.reshard_after_forward = zero_stage >= 3
        self.offload = offload and device.type == "cuda"
        self.gradient_checkpointing = gradient_checkpointing

    def wrap(self, model: nn.Module, *, trainable: bool = True) -> nn.Module:
        """Shard each transformer block, then the root, over this role's ranks."""
        if self.gradient_checkpointing and trainable and hasattr(model, "gradient_checkpointing_enable"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.to(self.device)
        mesh = DeviceMesh.from_group(self.group, self.device.type)
        kwargs: dict = {"mesh": mesh, "reshard_after_forward": self.reshard_after_forward or not trainable}
        if self.bf16:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if self.offload:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        block_names = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            if type(module).__name__ in block_names:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        if not trainable:
            model.requires_grad_(False)
        return model

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """Clip over all shards; returns the total norm before clipping (inf/nan when non-finite)."""
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        return float(_full(norm))

    def full_params(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every parameter. Collective: every rank of the role must iterate."""
        for name, param in model.named_parameters():
            yield name, _full(param.detach())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full CPU tensors on the role's first rank ({} elsewhere). Collective over the role."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
