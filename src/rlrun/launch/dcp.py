"""Sharded, world-size-independent save/load of a role's model + optimizer (torch DCP)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def save_role_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: str, group: dist.ProcessGroup) -> None:
    """Collective over the role's group: each rank writes its own shards into `path`."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path, process_group=group)


def load_role_state(model: nn.Module, optimizer: torch.optim.Optimizer, path: str, group: dist.ProcessGroup) -> None:
    """Collective over the role's group; DCP reshards when the role now has a different size."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def barrier(group: dist.ProcessGroup, timeout_s: float) -> None:
    # monitored_barrier names the rank that did not arrive (gloo only); NCCL gets a plain barrier.
    if dist.get_backend(group) == "gloo":
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s))
    else:
        dist.barrier(group=group)
