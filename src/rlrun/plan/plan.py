"""A trainer's plan: its command line parsed, resolved and checked into a validated config and (PPO) a role layout,
on every rank before any process group, model or dataset exists. What `--dry_run` prints and every run starts from.

PPO (`plan_ppo`): hub ids and presets resolved, the generation backend chosen (`choose_generation`: the same on
every rank, from the config, the policy's config.json and whether a GPU and vLLM are present), every value and
cross-field rule checked (rlrun.plan.checks), the roles laid out (rlrun.plan.placement) with the batch sizes checked
against them. The supervised trainers (`plan_supervised`): one data-parallel role on every rank, the same checks of
what they share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from rlrun.algo.algorithms import gamma_override_warning
from rlrun.algo.rollout_correction import OFF, RolloutCorrection
from rlrun.cli.parser import CliSpec, ParsedArgs, parse_args
from rlrun.compat import correction
from rlrun.config.model import VL_PRESET
from rlrun.config.supervised import DPOConfig, SFTConfig, SupervisedConfig
from rlrun.config.tree import Config, RootConfig
from rlrun.data.sources import missing_paths
from rlrun.engines.build import choose_host, describe_host
from rlrun.launch.dist import uses_cuda
from rlrun.launch.env import DistEnv, read_node_label
from rlrun.launch.layout import Layout, LayoutRequest, Role, RoleRequest, format_layout_table, layout_heading
from rlrun.models.adapter_pretrain import lora_settings, resolve_adapter_pretrain
from rlrun.models.hub import resolve, resolve_models
from rlrun.models.lora import refuse_adapter_as_reference
from rlrun.plan.checks import (
    check_batches,
    check_lora,
    check_strategy,
    check_supervised,
    check_values,
)
from rlrun.plan.placement import plan_layout
from rlrun.plan.sequence_parallel import (
    check_sequence_parallel_model,
    check_sequence_parallel_models,
    packed_for_sequence_parallel,
    sequence_parallel_sizes,
)
from rlrun.plan.speed import resolve_speed, speed_line
from rlrun.rewards.reward_fn import DEMO
from rlrun.runtime.errors import ConfigError

C = TypeVar("C", bound=RootConfig)


@dataclass(frozen=True)
class Planned(Generic[C]):
    """A command line parsed, resolved and checked on this rank: the config the run uses, and what to say of it."""

    config: C
    warnings: tuple[str, ...] = ()  # said at start-up and by --dry_run (flags with no effect, the layout's notes)
    notes: tuple[str, ...] = ()  # --dry_run's lines before the memory plan (the role layout)
    roles: str = ""  # what this rank plays, as its failure line names it


@dataclass(frozen=True)
class PPOPlan(Planned[Config]):
    """rlrun.ppo's plan: the role layout (placed by node label already on one node; on more, again at start-up once
    every node's label is known) and why generation runs on its backend."""

    layout: Layout | None = None
    generation_why: str = ""
    speed: str = ""  # the start-up line naming the speed settings (rlrun.plan.speed)
    # the rollout correction, resolved from whichever peer's spelling the run uses (rlrun.compat.correction)
    correction: RolloutCorrection = OFF


# ---- rlrun.ppo --------------------------------------------------------------------------------------------------


def plan_ppo(argv: Sequence[str] | None, env: DistEnv) -> PPOPlan:
    """rlrun.ppo's command line into its plan (raises the run's ConfigError/LayoutError on what would fail)."""
    parsed = parse_args(argv)
    runtime = parsed.config.runtime
    # a dry run planned for GPUs off a GPU node (--gpu_memory_gb) resolves the speed settings as the GPU run will
    planned_gpu = runtime.dry_run and runtime.device != "cpu" and runtime.gpu_memory_gb is not None
    cuda = uses_cuda(runtime.device) or planned_gpu
    cfg = resolve_speed(resolved_ppo_models(parsed.config), cuda, parsed.explicit)
    train, packed = packed_for_sequence_parallel(
        cfg.train, max(sequence_parallel_sizes(cfg).values()), cfg.model.flash_attn
    )
    cfg = replace(cfg, train=train)
    # One node: its label is this process's own, so pinned roles are placed (and checked) now; with more
    # nodes the labels are gathered at start-up (rlrun.rl.assembly) and the placement is redone there.
    one_node = env.world_size == env.local_world_size
    labels = (read_node_label(),) if asks_node_labels(cfg) and one_node else None
    first = lay_out(cfg, env.world_size, env.local_world_size, labels)
    # Bad values and layouts have failed by now, in a second: what follows reads config.json with transformers.
    from rlrun.plan.generation import check_vision_run, choose_generation  # noqa: PLC0415

    choice = choose_generation(cfg, uses_cuda(runtime.device))
    check_vision_run(choice.config)
    check_sequence_parallel_models(choice.config, sequence_parallel_sizes(choice.config))
    cfg = choice.config
    the_plan = (
        first
        if choice.backend == parsed.config.generation.generation_backend
        else lay_out(cfg, env.world_size, env.local_world_size, labels)
    )
    layout = the_plan.layout
    why = choice.why
    if choice.backend == "vllm":
        tp = cfg.resources.vllm_tensor_parallel_size
        why += f"; {describe_host(choose_host(cfg.generation.vllm_engine_host, layout, tp), tp)}"
    notes = [choice.assumed] if choice.assumed is not None else []
    notes.append(f"{layout_heading(env)}\n{format_layout_table(layout)}")
    if asks_node_labels(cfg) and not one_node:
        notes.append(
            "roles pinned by --*_node_label are placed at start-up, once every node has reported its label "
            "(RLRUN_NODE_LABEL, else the host name); the table above ignores the labels"
        )
    return PPOPlan(
        cfg,
        warnings=(*parsed.ignored_under(choice.backend), *packed, *the_plan.warnings),
        notes=tuple(notes),
        roles=roles_of(layout, env.rank),
        layout=layout,
        generation_why=why,
        speed=speed_line(cfg, cuda, parsed.explicit),
        correction=correction.resolve(cfg.correction, cfg.algo.policy_loss_type),
    )


def resolved_ppo_models(cfg: Config) -> Config:
    """--model_preset tiny-vl as a saved model (and data) in rlrun's cache; hub ids as their cached snapshots
    (downloaded now, unless this is a dry run or HF_HUB_OFFLINE=1); an adapter directory as --pretrain as its base
    with its LoRA settings in the config (the layout and the memory plan follow them)."""
    download = not cfg.runtime.dry_run
    model, data = cfg.model, cfg.data
    if model.model_preset == VL_PRESET and model.pretrain is None:
        # Builds (once) and saves a tiny Qwen2.5-VL with transformers: imported only for the preset.
        from rlrun.vision.demo import resolve_vl_preset  # noqa: PLC0415

        model, data = resolve_vl_preset(model, data, cfg.train.seed)
    model = resolve_adapter_pretrain(resolve_models(model, download=download), download=download)
    cfg = replace(cfg, model=model, data=data)
    check_adapter_reference(cfg)
    return cfg


def roles_of(layout: Layout, rank: int) -> str:
    """This rank's roles as its failure line names them ("actor,ref,engine")."""
    return ",".join(r.value for r in layout.roles_of(rank))


def check_adapter_reference(cfg: Config) -> None:
    """A LoRA adapter directory as --pretrain with a KL term: the actor's adapters-off forward, the reference the
    layout relies on (Config.ref_is_actor_base), would be the adapter's base, not the policy the run starts from."""
    if cfg.ref_is_actor_base:
        refuse_adapter_as_reference(
            cfg.model.pretrain,
            f"the run has a KL term (--init_kl_coef "
            f"{cfg.algo.init_kl_coef}, "
            f"--use_kl_loss {cfg.algo.use_kl_loss}) scored by the actor's adapters-off forward",
            ", or drop the KL term",
        )


def layout_request(cfg: Config) -> LayoutRequest:
    r = cfg.resources
    return LayoutRequest(
        actor=RoleRequest(r.actor_num_nodes, r.actor_num_gpus_per_node, r.actor_node_label),
        critic=RoleRequest(r.critic_num_nodes, r.critic_num_gpus_per_node, r.critic_node_label),
        ref=RoleRequest(r.ref_num_nodes, r.ref_num_gpus_per_node, r.ref_node_label),
        reward=RoleRequest(r.reward_num_nodes, r.reward_num_gpus_per_node, r.reward_node_label),
        teacher=RoleRequest(r.teacher_num_nodes, r.teacher_num_gpus_per_node, r.teacher_node_label),
        need_critic=cfg.algo.needs_critic,
        need_ref=cfg.algo.needs_ref and not cfg.ref_is_actor_base,
        ref_is_actor_base=cfg.ref_is_actor_base,
        need_reward=cfg.reward.needs_reward_model,
        need_teacher=cfg.distill.teacher_pretrain is not None,
        vllm_num_engines=r.vllm_num_engines,
        vllm_tensor_parallel_size=r.vllm_tensor_parallel_size,
        colocate_actor_ref=r.colocate_actor_ref,
        colocate_actor_teacher=r.colocate_actor_teacher,
        colocate_critic_reward=r.colocate_critic_reward,
        colocate_all_models=r.colocate_all_models,
        engine_node_label=r.engine_node_label,
        async_train=cfg.train.async_train,
        partial_rollout=cfg.train.continues_rollouts,
        # A vLLM child's tensor-parallel workers read the weights from the file its engine's first rank writes.
        sync_engine_leaders=cfg.generation.generation_backend == "vllm" and r.vllm_tensor_parallel_size > 1,
        many_senders=cfg.generation.weight_sync_senders == "all" and lora_settings(cfg.model) is None,
        sequence_parallel=tuple(sequence_parallel_sizes(cfg).items()),
    )


def asks_node_labels(cfg: Config) -> bool:
    """Whether any role is pinned to a node label (then the run gathers every node's label at start-up)."""
    r = cfg.resources
    return any(
        label is not None
        for label in (
            r.actor_node_label,
            r.critic_node_label,
            r.ref_node_label,
            r.teacher_node_label,
            r.reward_node_label,
            r.engine_node_label,
        )
    )


@dataclass(frozen=True)
class LaidOut:
    layout: Layout
    warnings: tuple[str, ...]


def lay_out(cfg: Config, world_size: int, ranks_per_node: int, node_labels: Sequence[str] | None = None) -> LaidOut:
    """Validate values, lay out roles, check batch divisibility. Pure: no I/O but path checks.
    node_labels (one per node) honour --X_node_label; None: placed as if no label were asked."""
    check_values(cfg)
    eval_warnings = check_eval(cfg)
    layout = plan_layout(layout_request(cfg), world_size, ranks_per_node, node_labels)
    # rows split over each role's data-parallel shares (a sequence-parallel group shares its rows)
    sizes = {
        role.value: len(layout.ranks_of(role)) // layout.sp_of(role)
        for role in Role
        if layout.has(role) and role is not Role.ENGINE
    }
    # The HF backend generates on every engine rank independently (TP needs vLLM).
    sizes["engine"] = len(layout.ranks_of(Role.ENGINE))
    check_batches(cfg, sizes)
    check_strategy(cfg, layout)
    if cfg.generation.generation_backend == "vllm":  # in_process on a layout that would hang: refused here
        choose_host(cfg.generation.vllm_engine_host, layout, cfg.resources.vllm_tensor_parallel_size)
    gamma = gamma_override_warning(cfg.algo.advantage_estimator, cfg.algo.gamma)
    algo_warnings = [gamma] if gamma is not None else []
    if cfg.algo.policy_loss_type == "gspo_token" and cfg.algo.dual_clip is not None:
        algo_warnings.append(
            f"--dual_clip {cfg.algo.dual_clip:g} (verl's clip_ratio_c): no effect with --policy_loss_type gspo_token, "
            "which has no dual clip (as verl's gspo)"
        )
    check_partial_rollout_layout(cfg, layout)
    if cfg.train.partial_rollout and cfg.train.max_staleness == 1:
        algo_warnings.append(
            "--partial_rollout with --max_staleness 1 is --async_train's loop: no response may "
            "outlive "
            "a weight sync, so none is continued; use --max_staleness 2 or more to continue them"
        )
    if cfg.train.async_queue_size != 1:
        algo_warnings.append(
            f"--async_queue_size {cfg.train.async_queue_size} ignored: rlrun's --async_train keeps "
            f"exactly "
            "one rollout batch in flight (one step off-policy, deterministic); with "
            "--partial_rollout, "
            "--max_staleness bounds how many versions old a sample may be"
        )
    return LaidOut(
        layout, tuple(layout.warnings) + tuple(eval_warnings) + tuple(algo_warnings) + tuple(missing_path_warnings(cfg))
    )


def check_partial_rollout_layout(cfg: Config, layout: Layout) -> None:
    """--partial_rollout overlaps the engines' generation with training: it needs engines on ranks of their own
    (where --async_train alone falls back to synchronous steps with a warning, this refuses), and whole prompts
    per engine (a group's samples stay in one engine's pool). Tensor-parallel engines are fine: their ranks vote
    before each generation round (partial_rollout.SequencePool)."""
    if not cfg.train.partial_rollout:
        return
    if not layout.asynchronous:
        raise ConfigError(
            "--partial_rollout needs the engines on ranks of their own, so that they generate while the "
            "others train; colocated engines have nothing to overlap: set --vllm_num_engines N with "
            "N x --vllm_tensor_parallel_size ranks beside the training ranks, and no "
            "--colocate_all_models"
        )
    engines = len(layout.engines)
    if cfg.train.rollout_batch_size % engines:
        raise ConfigError(
            f"--partial_rollout: --rollout_batch_size {cfg.train.rollout_batch_size} must be a multiple "
            f"of the {engines} engines (each engine generates whole groups of its own prompts)"
        )


def check_eval(cfg: Config) -> list[str]:
    """Evaluation settings, before anything starts; returns warnings. Eval rollouts are rewarded on the engine
    ranks, where only a reward function or URL lives (OpenRLHF 0.11.2 likewise requires --remote_rm_url for
    --eval_dataset)."""
    lg, ev = cfg.logging, cfg.eval
    if ev.eval_dataset is None:
        if lg.eval_steps > 0 or lg.eval_before_train:
            flag = f"--eval_steps {lg.eval_steps}" if lg.eval_steps > 0 else "--eval_before_train"
            # OpenRLHF command lines often carry --eval_steps without a dataset; it does nothing there either.
            return [f"{flag} has no effect without --eval_dataset; no evaluation will run"]
        return []
    if cfg.reward.needs_reward_model:
        raise ConfigError(
            f"--eval_dataset {ev.eval_dataset}: evaluation rewards responses on the generation ranks "
            f"with "
            "a reward function or URL, but rewards come from --reward_pretrain (a reward model); pass "
            "--remote_rm_url FILE.py or http(s)://..., or drop --eval_dataset"
        )
    if lg.eval_steps == 0 or lg.eval_steps < -1:
        raise ConfigError(f"--eval_steps {lg.eval_steps} must be a positive step count, or -1 (never)")
    if ev.eval_n_samples_per_prompt < 1:
        raise ConfigError(f"--eval_n_samples_per_prompt {ev.eval_n_samples_per_prompt} must be >= 1")
    if ev.eval_temperature <= 0:
        raise ConfigError(f"--eval_temperature {ev.eval_temperature} must be > 0 (evaluation samples)")
    if lg.eval_steps == -1 and not lg.eval_before_train:
        return [
            f"--eval_dataset {ev.eval_dataset} is set but --eval_steps is -1 and --eval_before_train is off; "
            "no evaluation will run"
        ]
    return []


def missing_path_warnings(cfg: Config) -> list[str]:
    """Paths this machine cannot see (hub ids not in its cache, other hosts' disks, an earlier stage's output):
    warnings, not errors, in a dry run; loading them later fails with a clear error."""
    m = cfg.reward
    models = [
        ("pretrain", cfg.model.pretrain),
        ("reward_pretrain", m.reward_pretrain),
        ("critic_pretrain", cfg.critic.critic_pretrain),
    ]
    if m.remote_rm_url not in (None, DEMO) and not m.remote_rm_url.startswith(("http://", "https://")):
        models.append(("remote_rm_url", m.remote_rm_url))
    # a data source is a path or a hub id, each optionally @DATA_DIR (rlrun.data.sources)
    return missing_paths(models, [("prompt_data", cfg.data.prompt_data), ("eval_dataset", cfg.eval.eval_dataset)])


# ---- rlrun.sft, rlrun.rm, rlrun.dpo -----------------------------------------------------------------------------


def check_sft_aux_loss(cfg: SFTConfig) -> None:
    """--aux_loss_coef against the policy (its config.json, read only when the flag is set), before any process
    group."""
    from rlrun.models.loading import load_model_config  # noqa: PLC0415 - transformers' config classes
    from rlrun.plan.generation import check_aux_loss  # noqa: PLC0415 - as plan_ppo imports it: after the fast checks

    coef = cfg.loss.aux_loss_coef
    check_aux_loss(coef, load_model_config(cfg.model) if coef > 0 else None, cfg.train.sequence_parallel_size)


def plan_supervised(argv: Sequence[str] | None, env: DistEnv, cli: CliSpec) -> Planned[SupervisedConfig]:
    """A supervised trainer's command line into its plan: every rank trains one data-parallel share."""
    parsed: ParsedArgs = parse_args(argv, cli)
    check_supervised(parsed.config, env.world_size, cli.prog)
    cfg = resolved_supervised_models(parsed.config)
    check_lora(cfg)  # reads --pretrain, so after it is resolved to a local path
    sp = cfg.train.sequence_parallel_size
    train, packed = packed_for_sequence_parallel(cfg.train, sp, cfg.model.flash_attn)
    cfg = replace(cfg, train=train)
    check_sequence_parallel_model(cfg.model, "pretrain", cfg.model.pretrain, sp, cli.prog)
    if isinstance(cfg, SFTConfig):
        check_sft_aux_loss(cfg)
    if isinstance(cfg, DPOConfig) and cfg.loss.ref_pretrain is not None:
        ref = replace(cfg.model, pretrain=cfg.loss.ref_pretrain)
        check_sequence_parallel_model(ref, "ref_pretrain", ref.pretrain, sp, "the reference")
    t, dp = cfg.train, env.world_size // sp
    shard = (
        f"every rank trains one data-parallel shard: {t.train_batch_size // dp} samples per rank"
        if sp == 1
        else f"{dp} data-parallel shards of {sp} sequence-parallel ranks: {t.train_batch_size // dp} samples per "
        f"shard, a 1/{sp} token share of each per rank,"
    )
    share = (
        f"{cli.prog}: {env.world_size} ranks (launcher {env.launcher}), {shard} and step in micro-batches of "
        f"{t.micro_train_batch_size}; --strategy {t.strategy} --zero_stage {t.zero_stage}"
    )
    models = [("pretrain", cfg.model.pretrain)]
    if isinstance(cfg, DPOConfig):
        models.append(("ref_pretrain", cfg.loss.ref_pretrain))
    missing = missing_paths(models, [("dataset", cfg.data.dataset), ("eval_dataset", cfg.data.eval_dataset)])
    return Planned(cfg, warnings=(*parsed.ignored, *packed, *missing), notes=(share,), roles=cli.prog.split()[-1])


def resolved_supervised_models(cfg: SupervisedConfig) -> SupervisedConfig:
    """Hub ids of --pretrain (and DPO's --ref_pretrain) as their cached snapshots (downloaded unless a dry run or
    HF_HUB_OFFLINE=1)."""
    download = not cfg.runtime.dry_run
    cfg = dataclasses.replace(cfg, model=resolve_models(cfg.model, download=download))
    cfg = dataclasses.replace(cfg, model=resolve_adapter_pretrain(cfg.model, download=download))
    if isinstance(cfg, DPOConfig) and cfg.loss.ref_pretrain is not None:
        ref = resolve(cfg.loss.ref_pretrain, "model", "ref_pretrain", download=download)
        cfg = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, ref_pretrain=ref))
    return cfg
