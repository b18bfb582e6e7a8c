"""rlrun.ppo's assembly: the PPO trainer the run skeleton drives (`PPO`), and what it builds on a rank from the config.

The only module of rl/ that reads the whole config: it hands every other component its own section. In the order
the skeleton calls it (rlrun.run.skeleton): the plan (rlrun.plan.plan.plan_ppo), what a rank reads before the first
collective (tokenizer, prompts, its reward function), the roles it plays (engine first, then actor, reference,
critic, reward model, and weight sync between actor and engines), the loop (rlrun.rl.trainer, or with
--async_train rlrun.rl.async_loop) and what its checkpoints hold, and the export.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlrun.agents.episodes import build_episode_runner
from rlrun.algo.rollout_correction import OFF, RolloutCorrection
from rlrun.checkpoint.checkpointer import Identity, JsonState, Part, SaveOnly
from rlrun.compat.openrlhf_checkpoint import OpenRLHFInit, init_from_openrlhf, read_openrlhf_init
from rlrun.config.algorithm import AlgorithmConfig
from rlrun.config.distill import DistillConfig
from rlrun.config.model import PretrainedConfig
from rlrun.config.training import TrainConfig
from rlrun.config.tree import Config
from rlrun.data.prompts import Prompts, PromptSampler, prompt_spec
from rlrun.engines.build import EngineImages, build_engine, engine_adapters, engine_dtype
from rlrun.engines.protocol import Engine
from rlrun.environments.factory import build_factory_episodes
from rlrun.environments.openenv import build_openenv_episodes
from rlrun.environments.programs import build_program_episodes
from rlrun.environments.tasksets import build_taskset_episodes
from rlrun.launch.context import RankContext
from rlrun.launch.env import DistEnv, read_node_label
from rlrun.launch.groups import Groups, SequenceParallel, build_groups
from rlrun.launch.layout import Layout, Role, format_layout_table, layout_heading
from rlrun.launch.transfer import gather_node_labels
from rlrun.models.adapter_pretrain import lora_settings
from rlrun.models.loading import (
    check_teacher_tokenizer,
    load_critic,
    load_model_config,
    load_reward_model,
    load_tokenizer,
    policy_weights,
    response_end_ids,
    teacher_source,
    trained_policy,
    unfilled_causal_lm,
)
from rlrun.models.lora import add_scalar_adapters
from rlrun.models.moe import config_routing_shape
from rlrun.models.weights import Unfilled
from rlrun.plan.memory_text import dry_run_memory
from rlrun.plan.plan import PPOPlan, asks_node_labels, lay_out, roles_of
from rlrun.plan.preflight import ppo_eval_prompts, ppo_prompts, preflight
from rlrun.plan.shapes import model_shape
from rlrun.reporting.live import PerfBasis, device_peak_flops, perf_line
from rlrun.reporting.run_report import describe_roles, model_form, pure_distillation_line, saved_outputs
from rlrun.rewards.compute_score import load_compute_score_function
from rlrun.rewards.reward_fn import RewardFunction, load_reward_function, no_reward
from rlrun.rl.async_loop import AsyncTrainer, PendingRollout
from rlrun.rl.dynamic_batch import role_budgets
from rlrun.rl.evaluation import Evaluator
from rlrun.rl.exchange import Exchange
from rlrun.rl.rollouts import RolloutSource
from rlrun.rl.sampling import Rewarding
from rlrun.rl.sleep import Sleeper, SleepSchedule
from rlrun.rl.trainer import RankRoles, StepSettings, Trainer
from rlrun.roles.actor import Actor, Reference, policy_loss_settings
from rlrun.roles.critic import Critic, RewardModel
from rlrun.roles.export import save_critic, save_policy
from rlrun.roles.update import Updater, make_optimizer, warmup_cosine
from rlrun.run.skeleton import Built, Started
from rlrun.runtime.errors import DataError
from rlrun.runtime.log import get_logger
from rlrun.runtime.phases import Phase, deadline
from rlrun.runtime.secrets import redact_text
from rlrun.strategies import ulysses
from rlrun.strategies.base import ModelState, Strategy
from rlrun.strategies.choose import make_strategy
from rlrun.vision.inputs import quiet_output_view_warning
from rlrun.vision.tower import freeze_by_prefix, freeze_vision_tower
from rlrun.weight_sync.sync import WeightSync, policy_weight_sync

TABLE_RANKS = 16  # a larger world's layout is one line at start-up (--dry_run prints its table)

# Settings a resume cannot change: what they mean is baked into the checkpoint's weights, optimizer state or
# position in the prompt order (step k trains on prompts [k * rollout_batch_size, ...) of the seed's order).
FIXED_ON_RESUME = {
    "pretrain": "the checkpoint's policy was trained from that model",
    "model_preset": "the checkpoint's policy was trained from that model",
    "critic_pretrain": "the checkpoint's critic was trained from that model",
    "advantage_estimator": "the checkpoint's critic, optimizer and statistics belong to that estimator",
    "prompt_data": "the checkpoint's step counts positions in that data",
    "prompt_split": "the checkpoint's step counts positions in that data",
    "prompt_data_probs": "the checkpoint's step counts positions in that blend",
    "max_samples": "the checkpoint's step counts positions in that many prompts",
    "rollout_batch_size": "the checkpoint's step counts positions in the prompt order in batches of that size",
    "seed": "the prompt order and every random draw of a step derive from it",
}


@dataclass
class Inputs:
    """What a rank reads before the first collective: a bad path fails every rank alike there."""

    tokenizer: PreTrainedTokenizerBase
    end_ids: tuple[int, ...]  # the token ids that end a response (EOS first)
    prompts: Prompts
    eval_prompts: Prompts | None
    sampler: PromptSampler
    total_steps: int
    rewarding: Rewarding  # how rollouts get their rewards (the function or agents: an engine rank's)
    openrlhf_init: OpenRLHFInit | None  # --load_openrlhf_checkpoint's files, checked
    node_label: str | None  # this node's, when roles are pinned to labels


class PPOTrainer:
    """rlrun.ppo's trainer for the run skeleton (rlrun.run.skeleton.Trainer), imported once its plan holds."""

    def memory(self, planned: PPOPlan, env: DistEnv) -> tuple[list[str], list[str]]:
        assert planned.layout is not None
        return dry_run_memory(planned.config, planned.layout, write_json=env.rank == 0)

    def preflight(self, planned: PPOPlan) -> list[str]:
        return preflight(planned.config)

    def read(self, planned: PPOPlan, started: Started) -> Inputs:
        cfg, log = planned.config, started.log
        assert planned.layout is not None
        tokenizer = load_tokenizer(cfg.model)
        if (teacher := cfg.distill.teacher_pretrain) is not None:
            check_teacher_tokenizer(cfg.model, teacher, tokenizer)
        lg = cfg.logging
        evaluates = cfg.eval.eval_dataset is not None and (lg.eval_steps > 0 or lg.eval_before_train)
        with deadline(
            cfg.runtime.data_timeout,
            lambda: DataError(
                f"loading the prompts (--prompt_data {cfg.data.prompt_data}"
                + (f", --eval_dataset {cfg.eval.eval_dataset}" if evaluates else "")
                + f") took over --data_timeout "
                f"{cfg.runtime.data_timeout:g} s; check the filesystem or network it comes from, or raise "
                f"--data_timeout"
            ),
        ):
            prompts = ppo_prompts(cfg, tokenizer, prompt_spec(cfg.data, cfg.train.seed))
            eval_prompts = ppo_eval_prompts(cfg, tokenizer) if evaluates else None
        sampler = make_sampler(cfg, prompts)
        total_steps = min(sampler.total_steps, cfg.train.max_steps or sampler.total_steps)
        log.info_once(
            f"{len(prompts.ids)} prompts ({prompts.truncated} truncated, {prompts.dropped} dropped at "
            f"--prompt_max_len {cfg.generation.prompt_max_len}), {total_steps} steps, generation backend "
            f"{cfg.generation.generation_backend} ({planned.generation_why}), {started.backend} on "
            f"{started.device.type}"
        )
        log.info_once(planned.speed)
        load = cfg.checkpoint.load_openrlhf_checkpoint
        return Inputs(
            tokenizer,
            response_end_ids(cfg.model, tokenizer),
            prompts,
            eval_prompts,
            sampler,
            total_steps,
            build_rewarding(cfg, planned.layout, started.env.rank, tokenizer),
            read_openrlhf_init(load, run_has_critic=cfg.algo.needs_critic) if load else None,
            read_node_label() if asks_node_labels(cfg) else None,
        )

    def announce(self, planned: PPOPlan, inputs: Inputs, env: DistEnv) -> list[str]:
        assert planned.layout is not None
        layout = [] if asks_node_labels(planned.config) else [layout_text(planned.layout, env)]
        return [*layout, describe_reward(planned.config)]

    def build(self, planned: PPOPlan, inputs: Inputs, started: Started) -> Built[Trainer]:
        cfg, env, phase, device = planned.config, started.env, started.phase, started.device
        layout = planned.layout
        assert layout is not None
        if inputs.node_label is not None:
            # Other nodes' labels are known only now: place the pinned roles before any group or model exists (still
            # start-up). Every rank plans from the same gathered labels, so an impossible request fails alike
            # everywhere.
            phase.set(Phase.STARTUP)
            labels = gather_node_labels(inputs.node_label, env.local_world_size, started.comm_device)
            started.failure.local_only = True
            layout = lay_out(cfg, env.world_size, env.local_world_size, labels).layout
            started.failure.local_only = False
            started.failure.roles = roles_of(layout, env.rank)
            inputs.rewarding = build_rewarding(cfg, layout, env.rank, inputs.tokenizer)  # engine ranks may move
            started.log.info_once("layout by node label:\n" + format_layout_table(layout))
            phase.set(Phase.BUILD)
        sync_backend = cfg.generation.vllm_sync_backend if device.type == "cuda" else None
        groups = build_groups(layout, cfg.runtime.dist_timeout, sync_backend, solo=cfg.train.strategy == "deepspeed")
        ctx = RankContext(layout, groups, device, cfg.train.seed, phase, inputs.tokenizer)
        roles = build_roles(ctx, cfg, inputs, planned.correction)
        replay = cfg.algo.router_replay
        routing = config_routing_shape(load_model_config(cfg.model)) if replay != "off" else None
        s = StepSettings(
            cfg.algo,
            cfg.train,
            cfg.generation.generate_max_len,
            inputs.end_ids,
            cfg.ref_is_actor_base,
            planned.correction,
            on_policy=skips_old_log_probs(cfg.train, cfg.algo, cfg.distill, planned.correction),
            distill=cfg.distill,
            recorded_routing=routing if replay == "R2" else None,
            perf=perf_basis(ctx, cfg.model) if ctx.rank == 0 else None,
        )
        rollouts = RolloutSource(
            ctx,
            cfg.train,
            cfg.generation,
            inputs.prompts,
            inputs.sampler,
            roles.engine,
            roles.rewarding,
            routing=routing if replay == "R3" else None,
        )
        evaluator = None
        if inputs.eval_prompts is not None:
            lg, ev = cfg.logging, cfg.eval
            evaluator = Evaluator(
                ctx, ev, lg, cfg.train, cfg.generation, inputs.eval_prompts, roles.engine, roles.rewarding
            )
            started.log.info_once(
                f"evaluating {len(inputs.eval_prompts.ids)} prompts x {ev.eval_n_samples_per_prompt} "
                f"samples (temperature {ev.eval_temperature:g})"
                + (f" every {lg.eval_steps} steps" if lg.eval_steps > 0 else "")
                + (" before training" if lg.eval_before_train else "")
            )
        if roles.sleep is not None:
            phase.on_enter = roles.sleep.enter
        loop = AsyncTrainer if layout.asynchronous else Trainer
        exchange = Exchange(ctx, role_budgets(cfg.train, groups, device), cfg.train.micro_rollout_batch_size)
        trainer = loop(ctx, s, exchange, roles, rollouts, inputs.total_steps, evaluator)
        if inputs.openrlhf_init is not None:  # before --load_checkpoint: rlrun's own newer checkpoint wins
            with phase(Phase.LOAD, -1):
                started.log.info_once(
                    init_from_openrlhf(
                        inputs.openrlhf_init,
                        roles.actor.model if roles.actor else None,
                        roles.critic.model if roles.critic else None,
                    )
                )
        actor = roles.actor
        return Built(
            trainer,
            Identity("ppo", cfg.train.strategy, "actor", actor.model if actor else None, FIXED_ON_RESUME),
            checkpoint_parts(cfg, trainer, inputs),
            groups.world,
            [r.model for r in (roles.actor, roles.critic) if r is not None],
        )

    def export(self, planned: PPOPlan, inputs: Inputs, built: Built[Trainer]) -> dict[str, str]:
        cfg, roles, rank = planned.config, built.job.roles, built.job.rank
        c = cfg.checkpoint
        save_policy(
            roles.actor,
            inputs.tokenizer,
            c.save_path,
            is_writer=rank == 0,
            strategy=roles.strategies.get(Role.ACTOR),
            allow_nonfinite=c.export_nonfinite,
            merged=c.save_merged,
            image_processor=inputs.prompts.image_processor,
        )
        critic = cfg.critic.save_value_network and roles.critic is not None
        if critic:
            assert roles.critic is not None  # `critic` says so
            save_critic(
                roles.critic,
                os.path.join(c.save_path, "critic"),
                is_writer=rank == built.job.layout.ranks_of(Role.CRITIC)[0],
                strategy=roles.strategies[Role.CRITIC],
                allow_nonfinite=c.export_nonfinite,
                merged=c.save_merged,
            )
        get_logger(rank).info_once(f"saved the policy {model_form(cfg.model, c)} to {c.save_path}")
        return saved_outputs(cfg.model, c, **({"critic": os.path.join(c.save_path, "critic")} if critic else {}))


# ---- what a checkpoint holds --------------------------------------------------------------------------------------


def checkpoint_parts(cfg: Config, trainer: Trainer, inputs: Inputs) -> list[Part]:
    """This rank's pieces of a checkpoint besides the trainer's state: the trained models with their optimizers
    (sharded, resharded on load), the critic's update loop, the HF exports asked for, and with --async_train the
    batch in flight. Frozen models (reference, reward) are reloaded from their source; RNG states are not kept
    (every random draw of a step derives from (seed, step, rank))."""
    roles, rank, c = trainer.roles, trainer.rank, cfg.checkpoint
    parts: list[Part] = []
    if (actor := roles.actor) is not None:
        strategy = roles.strategies[Role.ACTOR]
        parts.append(ModelState(strategy, actor.model, actor.updater.optimizer, "actor"))
        if c.save_hf_ckpt:
            parts.append(
                SaveOnly(
                    lambda path: save_policy(
                        actor,
                        inputs.tokenizer,
                        os.path.join(path, "hf"),
                        is_writer=rank == 0,
                        strategy=strategy,
                        allow_nonfinite=True,
                        merged=c.save_merged,
                        image_processor=inputs.prompts.image_processor,
                    )
                )
            )
    if (critic := roles.critic) is not None:
        strategy = roles.strategies[Role.CRITIC]
        first = rank == trainer.layout.ranks_of(Role.CRITIC)[0]
        parts.append(
            ModelState(
                strategy,
                critic.model,
                critic.updater.optimizer,
                "critic",
                missing=f"but this run trains a critic (--advantage_estimator {cfg.algo.advantage_estimator})",
            )
        )
        parts.append(JsonState(critic.updater, "critic_state.json", writer=first))
        if cfg.critic.save_value_network:
            parts.append(
                SaveOnly(
                    lambda path: save_critic(
                        critic,
                        os.path.join(path, "critic_hf"),
                        is_writer=first,
                        strategy=strategy,
                        allow_nonfinite=True,
                        merged=c.save_merged,
                    )
                )
            )
    if isinstance(trainer, AsyncTrainer):
        parts.append(PendingRollout(trainer, writer=rank == 0))
    return parts


# ---- what a rank reads and says before the first collective -------------------------------------------------------


def make_sampler(cfg: Config, prompts: Prompts) -> PromptSampler:
    kept, batch = len(prompts.ids), cfg.train.rollout_batch_size
    if prompts.dropped and kept < batch:
        raise DataError(
            f"{prompts.dropped} of {prompts.dropped + kept} prompts are longer than --prompt_max_len "
            f"{cfg.generation.prompt_max_len} and were dropped (--prompt_overflow drop); the {kept} left "
            f"do not fill one --rollout_batch_size {batch}. Raise --prompt_max_len, use --prompt_overflow "
            "truncate, or lower --rollout_batch_size."
        )
    return PromptSampler(len(prompts.ids), cfg.train.rollout_batch_size, cfg.train.seed, cfg.train.num_episodes)


def build_rewarding(cfg: Config, layout: Layout, rank: int, tokenizer: PreTrainedTokenizerBase) -> Rewarding:
    """How rollouts get their rewards: on an engine rank its reward function or agents (nothing elsewhere, nor when
    a reward model scores). Imports a reward or agent file but contacts no server, so it is read before the first
    collective."""
    known = Rewarding(episodes=cfg.agent.multi_turn, scored_later=cfg.reward.needs_reward_model)
    if Role.ENGINE not in layout.roles_of(rank) or cfg.reward.needs_reward_model:
        return known
    m = cfg.reward
    served, slot = cfg.model.pretrain or "rlrun-demo", layout.ranks_of(Role.ENGINE).index(rank)
    fn = reward_function(cfg, layout) if cfg.agent.adds_reward_function and m.names_reward_function else None
    if cfg.agent.agent_command is not None:
        return replace(known, agents=build_program_episodes(cfg.agent, cfg.generation, tokenizer, fn, served, slot))
    if cfg.agent.openenv_url is not None or cfg.agent.openenv_app is not None:
        return replace(known, agents=build_openenv_episodes(cfg.agent, cfg.generation, tokenizer, served, slot))
    if cfg.agent.env_id is not None:
        episodes = build_taskset_episodes(
            cfg.agent, cfg.generation, tokenizer, served, cfg.model.pretrain, slot, cfg.train.max_samples
        )
        return replace(known, agents=episodes)
    if cfg.agent.environment_factory is not None:
        data = cfg.data.apply_chat_template_kwargs
        trl = build_factory_episodes(cfg.agent, cfg.generation, data, tokenizer, fn, served, slot)
        return replace(known, agents=trl)
    if cfg.agent.multi_turn:
        return replace(known, agents=build_episode_runner(cfg.agent, cfg.generation, tokenizer, m.remote_rm_retries))
    return replace(known, reward_fn=reward_function(cfg, layout))


def reward_function(cfg: Config, layout: Layout) -> RewardFunction:
    """The run's reward function: --compute_score's, none for pure distillation, else --remote_rm_url's (the demo
    rule when unset)."""
    m = cfg.reward
    if m.compute_score is not None:
        return load_compute_score_function(
            m.compute_score,
            m.compute_score_name,
            workers=reward_workers(cfg, layout),
            call_timeout_s=cfg.reward_call_timeout,
        )
    if cfg.scores_nothing:
        return no_reward()
    return load_reward_function(
        m.remote_rm_url,
        timeout_s=m.remote_rm_timeout,
        retries=m.remote_rm_retries,
        call_timeout_s=cfg.reward_call_timeout,
    )


def reward_workers(cfg: Config, layout: Layout) -> int:
    """--reward_workers, or up to 8 processes per rank sharing the node's cores with its other ranks."""
    if cfg.reward.reward_workers is not None:
        return cfg.reward.reward_workers
    return max(1, min(8, (os.cpu_count() or 1) // max(1, layout.ranks_per_node)))


def describe_reward(cfg: Config) -> str:
    """Where a PPO run's rewards come from, in one line (URLs without credentials)."""
    m, ag = cfg.reward, cfg.agent
    if m.needs_reward_model:
        return f"reward: the reward model --reward_pretrain {m.reward_pretrain}"
    if ag.agent_func_path is not None:
        return f"reward: the episodes of the agent --agent_func_path {ag.agent_func_path}"
    if ag.openenv_url is not None:
        return f"reward: the {ag.openenv_reward} of the OpenEnv server's step rewards ({redact_text(ag.openenv_url)})"
    if ag.openenv_app is not None:
        return f"reward: the {ag.openenv_reward} of the step rewards of --openenv_app {ag.openenv_app} (started here)"
    if ag.env_id is not None:
        return f"reward: the rubric of the verifiers taskset --env_id {ag.env_id} (episodes through the token gateway)"
    if ag.environment_factory is not None:
        added = " + the reward function over each transcript" if m.names_reward_function else ""
        return f"reward: get_reward() of --environment_factory {ag.environment_factory}{added} (via the token gateway)"
    if ag.agent_command is not None:
        added = " + the reward function over each transcript" if m.names_reward_function else ""
        return f"reward: what each episode's --agent_command {ag.agent_command!r} prints{added} (via the token gateway)"
    if ag.retriever_url is not None:
        return f"reward: the built-in Search-R1 agent's episodes (retriever {redact_text(ag.retriever_url)})"
    if m.compute_score == "builtin":
        return (
            "reward: rlrun's versions of verl's rule scores, chosen per prompt by its data source "
            "(--compute_score builtin)"
        )
    if m.compute_score is not None:
        return f"reward: {m.compute_score_name}() of --compute_score {m.compute_score} (verl's convention), per sample"
    if cfg.scores_nothing:
        return pure_distillation_line(cfg.distill.teacher_pretrain)
    if m.remote_rm_url is None or m.remote_rm_url == "demo":
        return "reward: the demo rule (the fraction of response characters that are digits / letters, as asked)"
    kind = "reward_func() of" if m.remote_rm_url.endswith(".py") else "the HTTP endpoint"
    return f"reward: {kind} --remote_rm_url {redact_text(m.remote_rm_url)}"


def layout_text(layout: Layout, env: DistEnv) -> str:
    head = layout_heading(env)
    if env.world_size <= TABLE_RANKS:
        return f"{head}\n{format_layout_table(layout)}"
    return (
        f"{head}: {describe_roles({role.value: layout.ranks_of(role) for role in Role if layout.has(role)})}; "
        "--dry_run prints the per-rank table"
    )


# ---- the roles of a rank ----------------------------------------------------------------------------------------


def build_roles(ctx: RankContext, cfg: Config, inputs: Inputs, correction: RolloutCorrection) -> RankRoles:
    """Every role this rank plays, built in the same role order on every rank (so the groups' collectives cannot
    interleave), and weight sync from the actor to the engines."""
    mine = set(ctx.layout.roles_of(ctx.rank))
    out = RankRoles(rewarding=inputs.rewarding)
    if inputs.prompts.image_processor is not None:
        quiet_output_view_warning()
    policies = _policies(cfg, sum(r in mine for r in (Role.ACTOR, Role.REF, Role.ENGINE)), ctx.rank)
    if Role.ENGINE in mine:
        # Engines first: vLLM sizes its KV cache from the device memory free when it starts (and refuses a
        # --vllm_gpu_memory_utilization share that is not free), so it must start before the training models
        # claim theirs.
        out.engine = _engine(ctx, cfg, next(policies), inputs)
    steps = optimizer_steps(cfg, inputs.total_steps)
    if Role.ACTOR in mine:
        out.actor = _actor(ctx, cfg, next(policies), correction, steps, out.strategies)
        if cfg.ref_is_actor_base:  # the layout has no reference ranks: the actor's base scores for it
            out.reference = _base_reference(cfg, out.actor)
    if Role.REF in mine:
        out.reference = _frozen_policy(ctx, cfg, Role.REF, next(policies), cfg.generation.temperature, out.strategies)
    if Role.TEACHER in mine:
        source = teacher_source(cfg.model, cfg.distill.teacher_pretrain)
        teacher = unfilled_causal_lm(source, cfg.train.seed, policy_weights(source, cfg.train.seed))
        out.teacher = _frozen_policy(ctx, cfg, Role.TEACHER, teacher, cfg.distill.teacher_temperature, out.strategies)
    if Role.CRITIC in mine:
        out.critic = _critic(ctx, cfg, steps, out.strategies)
    if Role.REWARD in mine and (reward_pretrain := cfg.reward.reward_pretrain) is not None:
        out.reward_model = _reward_model(ctx, cfg, reward_pretrain, out.strategies)
    out.weight_sync = _weight_sync(ctx, cfg, out)
    if cfg.train.sleep:  # models move off the device between the phases that use them
        actor_scores = not skips_old_log_probs(cfg.train, cfg.algo, cfg.distill, correction) or cfg.ref_is_actor_base
        out.sleep = sleep_schedule(ctx.layout, ctx.rank, out, ctx.device, actor_scores=actor_scores)
    return out


def _engine(ctx: RankContext, cfg: Config, policy: Unfilled[PreTrainedModel], inputs: Inputs) -> Engine:
    """This engine rank's engine over the initial policy, held in the engines' dtype."""
    # on the meta device: the weights are read in this dtype (the ignore: transformers types PreTrainedModel.to
    # through functools.wraps, which mypy does not bind to the instance)
    policy.model.to(engine_dtype(cfg.model.bf16, ctx.device))  # type: ignore[arg-type]
    processor = inputs.prompts.image_processor
    return build_engine(
        ctx,
        cfg.generation,
        policy,
        inputs.end_ids,
        timeout_s=cfg.runtime.dist_timeout,
        images=None if processor is None else EngineImages(processor, cfg.vision.max_images_per_prompt),
        record_routing=cfg.algo.router_replay == "R3",
        adapters=engine_adapters(cfg.model, cfg.generation, cfg.resources.vllm_tensor_parallel_size),
    )


def _actor(
    ctx: RankContext,
    cfg: Config,
    unfilled: Unfilled[PreTrainedModel],
    correction: RolloutCorrection,
    opt_steps: int,
    strategies: dict[Role, Strategy],
) -> Actor:
    """The policy being trained: wrapped by its strategy, its optimizer and update loop, its loss settings."""
    a, t = cfg.algo, cfg.train
    strategy = strategies[Role.ACTOR] = _strategy(ctx, cfg, Role.ACTOR)
    policy = trained_policy(unfilled, cfg.model, t.seed)
    if cfg.vision.freeze_visual_encoder:
        freeze_vision_tower(policy.model)
    if cfg.vision.freeze_prefix:
        freeze_by_prefix(policy.model, cfg.vision.freeze_prefix)
    model, updater = _updater(ctx, cfg, policy, strategy, t.actor_learning_rate, opt_steps, Role.ACTOR)
    settings = policy_loss_settings(a, cfg.distill, cfg.generation.temperature, a.loss_params(), correction)
    sp = sequence_parallel(ctx.groups, Role.ACTOR, model, t.packing_samples)
    return Actor(
        model, updater, settings, ctx.device, packing=t.packing_samples, logits_chunk=t.logits_chunk_size, sp=sp
    )


def _base_reference(cfg: Config, actor: Actor) -> Reference:
    """LoRA with a KL term: the actor's own model with its adapters switched off scores the reference log-probs."""
    t = cfg.train
    return Reference(
        actor.model,
        cfg.generation.temperature,
        actor.device,
        packing=t.packing_samples,
        logits_chunk=t.logits_chunk_size,
        adapters_off=True,
        sp=actor.sp,
        replay=cfg.algo.router_replay == "R3",
    )


def _critic(ctx: RankContext, cfg: Config, opt_steps: int, strategies: dict[Role, Strategy]) -> Critic:
    """The value model (GAE): from --critic_pretrain, the reward model, or the policy's body; LoRA like the actor."""
    c, t = cfg.critic, cfg.train
    strategy = strategies[Role.CRITIC] = _strategy(ctx, cfg, Role.CRITIC)
    critic: Unfilled = load_critic(
        cfg.model, c.critic_pretrain, cfg.reward.reward_pretrain, t.seed, normalize=cfg.algo.normalize_reward
    )
    if (lora := lora_settings(cfg.model)) is not None:
        critic = add_scalar_adapters(critic, lora, t.seed)
    model, updater = _updater(ctx, cfg, critic, strategy, c.critic_learning_rate, opt_steps, Role.CRITIC)
    sp = sequence_parallel(ctx.groups, Role.CRITIC, model, t.packing_samples)
    return Critic(model, updater, c.value_clip, cfg.algo.loss_agg_mode, ctx.device, packing=t.packing_samples, sp=sp)


def _reward_model(ctx: RankContext, cfg: Config, reward_pretrain: str, strategies: dict[Role, Strategy]) -> RewardModel:
    """The frozen reward model (--reward_pretrain), run like the policy."""
    strategy = strategies[Role.REWARD] = _strategy(ctx, cfg, Role.REWARD)
    unfilled = load_reward_model(cfg.model, reward_pretrain, cfg.train.seed, normalize=cfg.algo.normalize_reward)
    model = strategy.wrap(unfilled, trainable=False)
    packing = cfg.train.packing_samples
    return RewardModel(
        model, ctx.device, packing=packing, sp=sequence_parallel(ctx.groups, Role.REWARD, model, packing)
    )


def _weight_sync(ctx: RankContext, cfg: Config, roles: RankRoles) -> WeightSync:
    actor = roles.actor
    strategy = roles.strategies[Role.ACTOR] if actor is not None else None
    return policy_weight_sync(
        ctx,
        cfg.model,
        cfg.generation,
        roles.engine,
        None if actor is None else actor.model,
        strategy,
        engine_adapters(cfg.model, cfg.generation, cfg.resources.vllm_tensor_parallel_size),
    )


def perf_basis(ctx: RankContext, model: PretrainedConfig) -> PerfBasis:
    """Rank 0: what the step's throughput and MFU are computed from (the peak measured on this rank's GPU, a
    fraction of a second), said in one start-up line."""
    basis = PerfBasis(
        params=model_shape(load_model_config(model)).parameters,
        devices=ctx.layout.world_size,
        actor_devices=len(ctx.layout.ranks_of(Role.ACTOR)),
        peak_flops=device_peak_flops(ctx.device),
    )
    get_logger(ctx.rank).info_once(perf_line(basis))
    return basis


def sleep_schedule(
    layout: Layout, rank: int, roles: RankRoles, device: torch.device, *, actor_scores: bool
) -> SleepSchedule:
    """--sleep: the schedule of this rank's models (rlrun.rl.sleep)."""
    sleepers = []
    if roles.actor is not None:
        sleepers.append(
            Sleeper(Role.ACTOR, roles.strategies[Role.ACTOR], roles.actor.model, roles.actor.updater.optimizer)
        )
    if roles.critic is not None:
        sleepers.append(
            Sleeper(Role.CRITIC, roles.strategies[Role.CRITIC], roles.critic.model, roles.critic.updater.optimizer)
        )
    # A reference that is the actor's LoRA base (adapters switched off) is the actor's model: it sleeps as the actor.
    if roles.reference is not None and not roles.reference.adapters_off:
        sleepers.append(Sleeper(Role.REF, roles.strategies[Role.REF], roles.reference.model, None))
    if roles.teacher is not None:
        sleepers.append(Sleeper(Role.TEACHER, roles.strategies[Role.TEACHER], roles.teacher.model, None))
    if roles.reward_model is not None:
        sleepers.append(Sleeper(Role.REWARD, roles.strategies[Role.REWARD], roles.reward_model.model, None))
    return SleepSchedule.of(sleepers, layout, rank, actor_scores=actor_scores, device=device)


def optimizer_steps(cfg: Config, total_steps: int) -> int:
    return total_steps * cfg.train.max_epochs * (cfg.train.rollouts_per_step // cfg.train.train_batch_size)


def _frozen_policy(
    ctx: RankContext,
    cfg: Config,
    role: Role,
    unfilled: Unfilled[PreTrainedModel],
    temperature: float,
    strategies: dict[Role, Strategy],
) -> Reference:
    """The reference's or the teacher's scorer: the frozen model wrapped by the role's strategy (sequence-parallel
    when the role is)."""
    strategy = strategies[role] = _strategy(ctx, cfg, role)
    model = strategy.wrap(unfilled, trainable=False)
    return Reference(
        model,
        temperature,
        ctx.device,
        packing=cfg.train.packing_samples,
        logits_chunk=cfg.train.logits_chunk_size,
        sp=sequence_parallel(ctx.groups, role, model, cfg.train.packing_samples),
        replay=role is Role.REF and cfg.algo.router_replay == "R3",  # the teacher is another model
    )


def sequence_parallel(groups: Groups, role: Role, model: torch.nn.Module, packing: bool) -> SequenceParallel | None:
    """This rank's sequence-parallel group of `role`, with the model's attention switched to Ulysses (None: no SP).
    Packed rows without SP switch it too where the model runs sdpa: each packed sequence then attends by itself."""
    sp = groups.sequence_parallel(role)
    if sp is not None or (packing and ulysses.packs_by_sequence(model)):
        ulysses.enable(model)
    return sp


def _strategy(ctx: RankContext, cfg: Config, role: Role) -> Strategy:
    group = ctx.groups.role(role)
    assert group is not None, role
    return make_strategy(group, ctx.device, cfg.model, cfg.train, ctx.groups.solo)


def _updater(
    ctx: RankContext,
    cfg: Config,
    model: torch.nn.Module | Unfilled,
    strategy: Strategy,
    lr: float,
    total_opt_steps: int,
    role: Role,
) -> tuple[torch.nn.Module, Updater]:
    """Wrap a trainable model and build its optimizer, schedule and update loop; returns (wrapped model, updater)."""
    t = cfg.train
    model, optimizer = strategy.wrap_trainable(model, lambda m: make_optimizer(m, lr, t.adam_betas, t.l2))
    scheduler = warmup_cosine(optimizer, total_opt_steps, t.lr_warmup_ratio)
    dp_rank, dp_size = ctx.layout.data_parallel(role, ctx.rank)  # a sequence-parallel group trains one share together
    return model, Updater(
        model,
        strategy,
        optimizer,
        scheduler,
        t.max_norm,
        t.micro_train_batch_size,
        dp_rank,
        dp_size,
        max_nonfinite_in_a_row=t.max_skipped_steps,
        ops=strategy.step_ops(model),
    )


def _policies(cfg: Config, count: int, rank: int) -> Iterator[Unfilled[PreTrainedModel]]:
    """The initial policy, unallocated, for each role of this rank that needs one: the weight files are opened once
    and each role's strategy reads only what that role keeps (no full copy per role, none at all when sharded)."""
    if count == 0:
        return
    weights = policy_weights(cfg.model, cfg.train.seed)
    for _ in range(count):
        unfilled = unfilled_causal_lm(cfg.model, cfg.train.seed, weights)
        if unfilled.note:
            get_logger(rank).warning_once(unfilled.note)
        yield unfilled


def skips_old_log_probs(
    train: TrainConfig, algo: AlgorithmConfig, distill: DistillConfig | None = None, correction: RolloutCorrection = OFF
) -> bool:
    """Whether Trainer.score skips the actor's "old log-probs" forward. True when nothing needs them before
    training (the KL is not a reward penalty: --use_kl_loss, or no reference model, i.e. --init_kl_coef 0; no
    teacher term in the advantages: a teacher without --teacher_kl_loss), and

    * with --rollout_bypass (verl's bypass mode): the engine's log-probs are the loss's old ones; or
    * the update is on-policy: --max_epochs 1 and ONE mini-batch per rollout batch (--train_batch_size ==
      --rollout_batch_size * --n_samples_per_prompt), so the training forward runs on the same weights the
      scoring pass would and the PPO ratio can use its detached log-probs (ratio 1 in value, the same
      gradient; TRL's GRPOTrainer does this), and no rollout correction weighs them against the engine's.

    The logged `kl` (and the adaptive controller's input) and the engine-vs-actor log-prob diff are then
    computed after training from the training forward's log-probs (Trainer.gather_on_policy_log_probs; the
    engine's in bypass mode), so they keep their meaning. Never with --router_replay R2, whose training passes
    replay the routing the scoring pass records (verl's actor always scores)."""
    if algo.router_replay == "R2":
        return False
    teacher_in_advantages = distill is not None and distill.on and not distill.teacher_kl_loss
    unneeded = (algo.use_kl_loss or not algo.needs_ref) and not teacher_in_advantages
    if correction.bypass:
        return unneeded
    on_policy = train.max_epochs == 1 and train.train_batch_size == train.rollouts_per_step
    return on_policy and unneeded and not correction.needs_old_log_probs
