"""From a Config to a validated Layout, before any process group, model or dataset exists."""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlrun.config import Config
from rlrun.launch.layout import Layout, LayoutRequest, Role, RoleRequest, plan_layout
from rlrun.validation import check_batches, check_values


def layout_request(cfg: Config) -> LayoutRequest:
    r = cfg.resources
    return LayoutRequest(
        actor=RoleRequest(r.actor_num_nodes, r.actor_num_gpus_per_node),
        critic=RoleRequest(r.critic_num_nodes, r.critic_num_gpus_per_node),
        ref=RoleRequest(r.ref_num_nodes, r.ref_num_gpus_per_node),
        reward=RoleRequest(r.reward_num_nodes, r.reward_num_gpus_per_node),
        need_critic=cfg.needs_critic,
        need_ref=cfg.needs_ref,
        need_reward=cfg.needs_reward_model,
        vllm_num_engines=r.vllm_num_engines,
        vllm_tensor_parallel_size=r.vllm_tensor_parallel_size,
        colocate_actor_ref=r.colocate_actor_ref,
        colocate_critic_reward=r.colocate_critic_reward,
        colocate_all_models=r.colocate_all_models,
    )


@dataclass(frozen=True)
class Plan:
    layout: Layout
    warnings: tuple[str, ...]


def plan(cfg: Config, world_size: int, ranks_per_node: int) -> Plan:
    """Validate values, lay out roles, check batch divisibility. Pure: no I/O but path checks."""
    check_values(cfg)
    layout = plan_layout(layout_request(cfg), world_size, ranks_per_node)
    sizes = {role.value: len(layout.ranks_of(role)) for role in Role if layout.has(role) and role is not Role.ENGINE}
    # The HF backend generates on every engine rank independently (TP needs vLLM).
    sizes["engine"] = len(layout.ranks_of(Role.ENGINE))
    check_batches(cfg, sizes)
    return Plan(layout, tuple(layout.warnings) + tuple(missing_path_warnings(cfg)))


def missing_path_warnings(cfg: Config) -> list[str]:
    """Paths this machine cannot see (hub names, other hosts' disks): warnings, not errors, in a
    dry run; loading them later fails with a clear error."""
    out = []
    candidates = {
        "pretrain": cfg.model.pretrain,
        "reward_pretrain": cfg.model.reward_pretrain,
        "critic_pretrain": cfg.model.critic_pretrain,
        "prompt_data": cfg.data.prompt_data,
    }
    if cfg.model.remote_rm_url and not cfg.model.remote_rm_url.startswith(("http://", "https://")):
        candidates["remote_rm_url"] = cfg.model.remote_rm_url
    for flag, path in candidates.items():
        if path is not None and not os.path.exists(path):
            out.append(f"--{flag} {path}: not found on this machine (a hub name or another host's path?)")
    return out
