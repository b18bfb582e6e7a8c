"""From a Config to a validated Layout, before any process group, model or dataset exists."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlrun.algo.algorithms import gamma_override_warning
from rlrun.config.schema import Config
from rlrun.config.validation import check_batches, check_values
from rlrun.data.sources import missing_paths
from rlrun.engines.hosting import choose_host
from rlrun.launch.layout import Layout, LayoutRequest, Role, RoleRequest
from rlrun.launch.layout_plan import plan_layout
from rlrun.models.lora import refuse_adapter_as_reference
from rlrun.rewards.reward_fn import DEMO
from rlrun.runtime.errors import ConfigError
from rlrun.strategies.checks import check_strategy


def check_adapter_reference(cfg: Config) -> None:
    """A LoRA adapter directory as --pretrain with a KL term: the actor's adapters-off forward, the reference the
    layout relies on (Config.ref_is_actor_base), would be the adapter's base, not the policy the run starts from."""
    if cfg.ref_is_actor_base:
        refuse_adapter_as_reference(cfg.model.pretrain, f"the run has a KL term (--init_kl_coef {cfg.algo.init_kl_coef}, "
                                    f"--use_kl_loss {cfg.algo.use_kl_loss}) scored by the actor's adapters-off forward",
                                    ", or drop the KL term")


def layout_request(cfg: Config) -> LayoutRequest:
    r = cfg.resources
    return LayoutRequest(
        actor=RoleRequest(r.actor_num_nodes, r.actor_num_gpus_per_node, r.actor_node_label),
        critic=RoleRequest(r.critic_num_nodes, r.critic_num_gpus_per_node, r.critic_node_label),
        ref=RoleRequest(r.ref_num_nodes, r.ref_num_gpus_per_node, r.ref_node_label),
        reward=RoleRequest(r.reward_num_nodes, r.reward_num_gpus_per_node, r.reward_node_label),
        need_critic=cfg.needs_critic,
        need_ref=cfg.needs_ref and not cfg.ref_is_actor_base,
        ref_is_actor_base=cfg.ref_is_actor_base,
        need_reward=cfg.needs_reward_model,
        vllm_num_engines=r.vllm_num_engines,
        vllm_tensor_parallel_size=r.vllm_tensor_parallel_size,
        colocate_actor_ref=r.colocate_actor_ref,
        colocate_critic_reward=r.colocate_critic_reward,
        colocate_all_models=r.colocate_all_models,
        engine_node_label=r.engine_node_label,
        async_train=cfg.train.async_train,
        partial_rollout=cfg.continues_rollouts,
        # A vLLM child's tensor-parallel workers read the weights from the file its engine's first rank writes.
        sync_engine_leaders=cfg.generation.generation_backend == "vllm" and r.vllm_tensor_parallel_size > 1,
    )


def asks_node_labels(cfg: Config) -> bool:
    """Whether any role is pinned to a node label (then the run gathers every node's label at start-up)."""
    r = cfg.resources
    return any(label is not None for label in (r.actor_node_label, r.critic_node_label, r.ref_node_label,
                                               r.reward_node_label, r.engine_node_label))


@dataclass(frozen=True)
class Plan:
    layout: Layout
    warnings: tuple[str, ...]


def plan(cfg: Config, world_size: int, ranks_per_node: int, node_labels: Sequence[str] | None = None) -> Plan:
    """Validate values, lay out roles, check batch divisibility. Pure: no I/O but path checks.
    node_labels (one per node) honour --X_node_label; None: placed as if no label were asked."""
    check_values(cfg)
    eval_warnings = check_eval(cfg)
    layout = plan_layout(layout_request(cfg), world_size, ranks_per_node, node_labels)
    sizes = {role.value: len(layout.ranks_of(role)) for role in Role if layout.has(role) and role is not Role.ENGINE}
    # The HF backend generates on every engine rank independently (TP needs vLLM).
    sizes["engine"] = len(layout.ranks_of(Role.ENGINE))
    check_batches(cfg, sizes)
    check_strategy(cfg, layout)
    if cfg.generation.generation_backend == "vllm":  # in_process on a layout that would hang: refused here
        choose_host(cfg.generation.vllm_engine_host, layout, cfg.resources.vllm_tensor_parallel_size)
    gamma = gamma_override_warning(cfg.algo.advantage_estimator, cfg.algo.gamma)
    algo_warnings = [gamma] if gamma is not None else []
    check_partial_rollout_layout(cfg, layout)
    if cfg.train.partial_rollout and cfg.train.max_staleness == 1:
        algo_warnings.append("--partial_rollout with --max_staleness 1 is --async_train's loop: no response may outlive "
                             "a weight sync, so none is continued; use --max_staleness 2 or more to continue them")
    if cfg.train.async_queue_size != 1:
        algo_warnings.append(f"--async_queue_size {cfg.train.async_queue_size} ignored: rlrun's --async_train keeps exactly "
                             "one rollout batch in flight (one step off-policy, deterministic); with --partial_rollout, "
                             "--max_staleness bounds how many versions old a sample may be")
    return Plan(layout, tuple(layout.warnings) + tuple(eval_warnings) + tuple(algo_warnings)
                + tuple(missing_path_warnings(cfg)))


def check_partial_rollout_layout(cfg: Config, layout: Layout) -> None:
    """--partial_rollout overlaps the engines' generation with training: it needs engines on ranks of their own
    (where --async_train alone falls back to synchronous steps with a warning, this refuses), and whole prompts
    per engine (a group's samples stay in one engine's pool). Tensor-parallel engines are fine: their ranks vote
    before each generation round (partial_rollout.SequencePool)."""
    if not cfg.train.partial_rollout:
        return
    if not layout.asynchronous:
        raise ConfigError("--partial_rollout needs the engines on ranks of their own, so that they generate while the "
                          "others train; colocated engines have nothing to overlap: set --vllm_num_engines N with "
                          "N x --vllm_tensor_parallel_size ranks beside the training ranks, and no --colocate_all_models")
    engines = len(layout.engines)
    if cfg.train.rollout_batch_size % engines:
        raise ConfigError(f"--partial_rollout: --rollout_batch_size {cfg.train.rollout_batch_size} must be a multiple "
                          f"of the {engines} engines (each engine generates whole groups of its own prompts)")


def check_eval(cfg: Config) -> list[str]:
    """Evaluation settings, before anything starts; returns warnings. Eval rollouts are rewarded on the engine
    ranks, where only a reward function or URL lives (OpenRLHF 0.11.2 likewise requires --remote_rm_url for
    --eval_dataset)."""
    lg = cfg.logging
    if lg.eval_dataset is None:
        if lg.eval_steps > 0 or lg.eval_before_train:
            flag = f"--eval_steps {lg.eval_steps}" if lg.eval_steps > 0 else "--eval_before_train"
            # OpenRLHF command lines often carry --eval_steps without a dataset; it does nothing there either.
            return [f"{flag} has no effect without --eval_dataset; no evaluation will run"]
        return []
    if cfg.needs_reward_model:
        raise ConfigError(f"--eval_dataset {lg.eval_dataset}: evaluation rewards responses on the generation ranks with "
                          "a reward function or URL, but rewards come from --reward_pretrain (a reward model); pass "
                          "--remote_rm_url FILE.py or http(s)://..., or drop --eval_dataset")
    if lg.eval_steps == 0 or lg.eval_steps < -1:
        raise ConfigError(f"--eval_steps {lg.eval_steps} must be a positive step count, or -1 (never)")
    if lg.eval_n_samples_per_prompt < 1:
        raise ConfigError(f"--eval_n_samples_per_prompt {lg.eval_n_samples_per_prompt} must be >= 1")
    if lg.eval_temperature <= 0:
        raise ConfigError(f"--eval_temperature {lg.eval_temperature} must be > 0 (evaluation samples)")
    if lg.eval_steps == -1 and not lg.eval_before_train:
        return [f"--eval_dataset {lg.eval_dataset} is set but --eval_steps is -1 and --eval_before_train is off; "
                "no evaluation will run"]
    return []


def missing_path_warnings(cfg: Config) -> list[str]:
    """Paths this machine cannot see (hub ids not in its cache, other hosts' disks, an earlier stage's output):
    warnings, not errors, in a dry run; loading them later fails with a clear error."""
    m = cfg.model
    models = [("pretrain", m.pretrain), ("reward_pretrain", m.reward_pretrain), ("critic_pretrain", m.critic_pretrain)]
    if m.remote_rm_url not in (None, DEMO) and not m.remote_rm_url.startswith(("http://", "https://")):
        models.append(("remote_rm_url", m.remote_rm_url))
    # a data source is a path or a hub id, each optionally @DATA_DIR (rlrun.data.sources)
    return missing_paths(models, [("prompt_data", cfg.data.prompt_data), ("eval_dataset", cfg.logging.eval_dataset)])
