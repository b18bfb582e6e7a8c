"""The role layout's section (rlrun.ppo): how many ranks and nodes each role takes, what shares ranks with what,
and node labels; rlrun.plan.placement places the roles from it. OpenRLHF's flag names: 'gpus' means ranks."""

from __future__ import annotations

from dataclasses import dataclass

from rlrun.config.fields import opt, positive


@dataclass
class ResourceConfig:
    """Role layout. 'gpus' in these OpenRLHF flags means ranks. No sizes given: every role on every rank."""

    actor_num_nodes: int | None = opt(None, "Nodes for the actor (ranks = nodes x gpus_per_node).")
    actor_num_gpus_per_node: int | None = opt(None, "Ranks per node for the actor.")
    critic_num_nodes: int | None = opt(None, "Nodes for the critic.")
    critic_num_gpus_per_node: int | None = opt(None, "Ranks per node for the critic.")
    ref_num_nodes: int | None = opt(None, "Nodes for the reference model.")
    ref_num_gpus_per_node: int | None = opt(None, "Ranks per node for the reference model.")
    teacher_num_nodes: int | None = opt(None, "Nodes for the distillation teacher (--teacher_pretrain).")
    teacher_num_gpus_per_node: int | None = opt(None, "Ranks per node for the distillation teacher.")
    reward_num_nodes: int | None = opt(None, "Nodes for the reward model.")
    reward_num_gpus_per_node: int | None = opt(None, "Ranks per node for the reward model.")
    vllm_num_engines: int | None = opt(
        None,
        "Number of generation engines on their own ranks (whatever the backend). "
        "Unset: engines share the actor's ranks.",
    )
    vllm_tensor_parallel_size: int = opt(1, "Ranks per generation engine.")
    colocate_actor_ref: bool = opt(False, "Reference model on the actor's ranks (same processes).")
    colocate_actor_teacher: bool = opt(False, "Distillation teacher on the actor's ranks (same processes).")
    colocate_critic_reward: bool = opt(False, "Reward model on the critic's ranks.")
    colocate_all_models: bool = opt(False, "Every role, engines included, on the same ranks.")
    ref_sequence_parallel_size: int | None = opt(None, "The reference model's (unset: --sequence_parallel_size).")
    critic_sequence_parallel_size: int | None = opt(None, "The critic's (unset: --sequence_parallel_size).")
    actor_node_label: str | None = opt(
        None, "Put the actor on nodes with this label (each node's RLRUN_NODE_LABEL, else its host name)."
    )
    critic_node_label: str | None = opt(
        None, "Put the critic on nodes with this label (RLRUN_NODE_LABEL, else the host name)."
    )
    teacher_node_label: str | None = opt(None, "Put the distillation teacher on nodes with this label.")
    ref_node_label: str | None = opt(
        None, "Put the reference model on nodes with this label (RLRUN_NODE_LABEL, else the host name)."
    )
    reward_node_label: str | None = opt(
        None, "Put the reward model on nodes with this label (RLRUN_NODE_LABEL, else the host name)."
    )
    engine_node_label: str | None = opt(
        None, "Put the generation engines on nodes with this label (RLRUN_NODE_LABEL, else the host name)."
    )

    def check(self) -> None:
        """The sizes are checked with the world they are laid out on (rlrun.plan.placement); the sequence-parallel
        sizes here."""
        for name in ("ref_sequence_parallel_size", "critic_sequence_parallel_size"):
            positive(name, getattr(self, name), allow_none=True)
