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
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlrun.agents.episodes import EpisodeRunner, build_episode_runner
from rlrun.algo.rollout_correction import RolloutCorrection
from rlrun.checkpoint.checkpointer import Identity, JsonState, Part, SaveOnly
from rlrun.compat.openrlhf_checkpoint import InitPlan, init_from_openrlhf, plan_init
from rlrun.config.tree import Config
from rlrun.data.prompts import Prompts, PromptSampler
from rlrun.engines.build import build_engine, engine_dtype
from rlrun.engines.decoder import fused_groups
from rlrun.launch.env import DistEnv, read_node_label
from rlrun.launch.groups import Groups, SequenceParallel, build_groups
from rlrun.launch.layout import Layout, Role, format_layout_table, layout_heading
from rlrun.launch.transfer import gather_node_labels
from rlrun.models.adapter_pretrain import lora_settings
from rlrun.models.loading import (
    load_critic,
    load_model_config,
    load_reward_model,
    load_tokenizer,
    policy_weights,
    response_end_ids,
    trained_policy,
    unfilled_causal_lm,
)
from rlrun.models.lora import add_scalar_adapters
from rlrun.models.moe import config_routing_shape
from rlrun.models.weights import Unfilled
from rlrun.plan.checks import pure_distillation_line, scores_nothing
from rlrun.plan.memory_text import dry_run_memory
from rlrun.plan.plan import PPOPlan, asks_node_labels, plan, roles_of
from rlrun.plan.preflight import (
    check_teacher_tokenizer,
    ppo_eval_prompts,
    ppo_prompts,
    preflight,
    prompt_spec,
    teacher_source,
)
from rlrun.reporting.run_report import describe_roles, model_form, saved_outputs
from rlrun.rewards.compute_score import load_compute_score_function
from rlrun.rewards.reward_fn import RewardFunction, load_reward_function, no_reward
from rlrun.rl.async_loop import AsyncTrainer, PendingRollout
from rlrun.rl.dynamic_batch import role_budgets
from rlrun.rl.evaluation import Evaluator
from rlrun.rl.exchange import Exchange
from rlrun.rl.rollouts import RolloutSource
from rlrun.rl.sleep import Sleeper, SleepSchedule
from rlrun.rl.trainer import RankRoles, StepSettings, Trainer, skips_old_log_probs
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
from rlrun.weight_sync.sync import MergedLoraParams, ParamSource, WeightSync

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
class RewardSources:
    """What rewards an engine rank's rollouts: a reward function, or agents whose episodes carry rewards."""

    reward_fn: RewardFunction | None = None
    agents: EpisodeRunner | None = None


@dataclass
class Inputs:
    """What a rank reads before the first collective: a bad path fails every rank alike there."""

    tokenizer: PreTrainedTokenizerBase
    end_ids: tuple[int, ...]  # the token ids that end a response (EOS first)
    prompts: Prompts
    eval_prompts: Prompts | None
    sampler: PromptSampler
    total_steps: int
    sources: RewardSources  # an engine rank's
    openrlhf_init: InitPlan | None  # --load_openrlhf_checkpoint's files, checked
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
        if cfg.distill.teacher_pretrain is not None:
            check_teacher_tokenizer(cfg, tokenizer)
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
            prompts = ppo_prompts(cfg, tokenizer, prompt_spec(cfg))
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
            build_reward_sources(cfg, planned.layout, started.env.rank, tokenizer),
            plan_init(load, run_has_critic=cfg.algo.needs_critic) if load else None,
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
            layout = plan(cfg, env.world_size, env.local_world_size, labels).layout
            started.failure.local_only = False
            started.failure.roles = roles_of(layout, env.rank)
            inputs.sources = build_reward_sources(cfg, layout, env.rank, inputs.tokenizer)  # engine ranks may move
            started.log.info_once("layout by node label:\n" + format_layout_table(layout))
            phase.set(Phase.BUILD)
        sync_backend = cfg.generation.vllm_sync_backend if device.type == "cuda" else None
        groups = build_groups(layout, cfg.runtime.dist_timeout, sync_backend, solo=cfg.train.strategy == "deepspeed")
        roles = build_roles(cfg, layout, groups, device, inputs, planned.correction)
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
        )
        rollouts = RolloutSource(
            cfg.train,
            cfg.generation,
            layout,
            groups,
            inputs.prompts,
            inputs.sampler,
            inputs.tokenizer,
            device,
            engine=roles.engine,
            reward_fn=roles.reward_fn,
            agents=roles.agents,
            episodes=cfg.agent.multi_turn,
            scored_later=cfg.reward.needs_reward_model,
            routing=routing if replay == "R3" else None,
        )
        evaluator = None
        if inputs.eval_prompts is not None:
            lg, ev = cfg.logging, cfg.eval
            evaluator = Evaluator(
                ev,
                lg,
                cfg.train,
                cfg.generation.prompt_max_len,
                layout,
                groups,
                inputs.eval_prompts,
                inputs.tokenizer,
                device,
                engine=roles.engine,
                reward_fn=roles.reward_fn,
                agents=roles.agents,
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
        exchange = Exchange(groups, role_budgets(cfg.train, groups, device), cfg.train.micro_rollout_batch_size, device)
        trainer = loop(s, layout, exchange, roles, rollouts, inputs.sampler, phase, inputs.total_steps, evaluator)
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


def build_reward_sources(cfg: Config, layout: Layout, rank: int, tokenizer: PreTrainedTokenizerBase) -> RewardSources:
    """The rollout reward source of an engine rank (nothing elsewhere, or when a reward model scores). Imports
    a reward or agent file but contacts no server, so it is read before the first collective."""
    if Role.ENGINE not in layout.roles_of(rank) or cfg.reward.needs_reward_model:
        return RewardSources()
    m = cfg.reward
    if cfg.agent.multi_turn:
        return RewardSources(agents=build_episode_runner(cfg.agent, cfg.generation, tokenizer, m.remote_rm_retries))
    if m.compute_score is not None:
        return RewardSources(
            reward_fn=load_compute_score_function(
                m.compute_score,
                m.compute_score_name,
                workers=reward_workers(cfg, layout),
                call_timeout_s=cfg.reward_call_timeout,
            )
        )
    if scores_nothing(cfg):
        return RewardSources(reward_fn=no_reward())
    return RewardSources(
        reward_fn=load_reward_function(
            m.remote_rm_url,
            timeout_s=m.remote_rm_timeout,
            retries=m.remote_rm_retries,
            call_timeout_s=cfg.reward_call_timeout,
        )
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
    if ag.retriever_url is not None:
        return f"reward: the built-in Search-R1 agent's episodes (retriever {redact_text(ag.retriever_url)})"
    if m.compute_score == "builtin":
        return (
            "reward: rlrun's versions of verl's rule scores, chosen per prompt by its data source "
            "(--compute_score builtin)"
        )
    if m.compute_score is not None:
        return f"reward: {m.compute_score_name}() of --compute_score {m.compute_score} (verl's convention), per sample"
    if scores_nothing(cfg):
        return pure_distillation_line(cfg)
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


def build_roles(
    cfg: Config, layout: Layout, groups: Groups, device: torch.device, inputs: Inputs, correction: RolloutCorrection
) -> RankRoles:
    """Every role this rank plays, built in the same role order on every rank (so the groups' collectives cannot
    interleave), and weight sync from the actor to the engines."""
    rank = groups.rank
    mine = set(layout.roles_of(rank))
    out = RankRoles()
    opt_steps = optimizer_steps(cfg, inputs.total_steps)
    a, g, images = cfg.algo, cfg.generation, inputs.prompts.image_processor
    actor_strategy = None
    lora = lora_settings(cfg.model)  # adapters on the trained models (actor, critic); engines get merged weights
    if images is not None:
        quiet_output_view_warning()
    policies = _policies(cfg, sum(r in mine for r in (Role.ACTOR, Role.REF, Role.ENGINE)), rank)
    if Role.ENGINE in mine:
        # Engines first: vLLM sizes its KV cache from the device memory free when it starts (and refuses a
        # --vllm_gpu_memory_utilization share that is not free), so it must start before the training models
        # claim theirs.
        unfilled = next(policies)
        # on the meta device: the weights are read in this dtype (the ignore: transformers types PreTrainedModel.to
        # through functools.wraps, which mypy does not bind to the instance)
        unfilled.model.to(engine_dtype(cfg.model.bf16, device))  # type: ignore[arg-type]
        out.engine = build_engine(
            g,
            unfilled,
            inputs.tokenizer,
            inputs.end_ids,
            layout=layout,
            groups=groups,
            device=device,
            seed=cfg.train.seed,
            tensor_parallel_size=cfg.resources.vllm_tensor_parallel_size,
            timeout_s=cfg.runtime.dist_timeout,
            image_processor=images,
            images_per_prompt=cfg.vision.max_images_per_prompt,
            record_routing=cfg.algo.router_replay == "R3",
        )
        out.reward_fn, out.agents = inputs.sources.reward_fn, inputs.sources.agents
    if Role.ACTOR in mine:
        actor_strategy = out.strategies[Role.ACTOR] = _strategy(cfg, groups, Role.ACTOR, device)
        settings = policy_loss_settings(a, cfg.distill, g.temperature, a.loss_params(), correction)
        policy = trained_policy(next(policies), cfg.model, cfg.train.seed)
        if cfg.vision.freeze_visual_encoder:
            freeze_vision_tower(policy.model)
        if cfg.vision.freeze_prefix:
            freeze_by_prefix(policy.model, cfg.vision.freeze_prefix)
        model, updater = _updater(
            cfg, policy, actor_strategy, cfg.train.actor_learning_rate, opt_steps, layout, Role.ACTOR, rank
        )
        actor_sp = sequence_parallel(groups, Role.ACTOR, model, cfg.train.packing_samples)
        out.actor = Actor(
            model,
            updater,
            settings,
            device,
            packing=cfg.train.packing_samples,
            logits_chunk=cfg.train.logits_chunk_size,
            sp=actor_sp,
        )
        if cfg.ref_is_actor_base:  # the layout has no reference ranks: the actor's base scores for it
            out.reference = Reference(
                model,
                g.temperature,
                device,
                packing=cfg.train.packing_samples,
                logits_chunk=cfg.train.logits_chunk_size,
                adapters_off=True,
                sp=actor_sp,
                replay=cfg.algo.router_replay == "R3",
            )
    if Role.REF in mine:
        out.strategies[Role.REF] = _strategy(cfg, groups, Role.REF, device)
        model = out.strategies[Role.REF].wrap(next(policies), trainable=False)
        out.reference = _frozen_policy(cfg, groups, Role.REF, model, g.temperature, device)
    if Role.TEACHER in mine:
        out.strategies[Role.TEACHER] = _strategy(cfg, groups, Role.TEACHER, device)
        of_teacher = teacher_source(cfg)
        teacher = unfilled_causal_lm(of_teacher, cfg.train.seed, policy_weights(of_teacher, cfg.train.seed))
        model = out.strategies[Role.TEACHER].wrap(teacher, trainable=False)
        out.teacher = _frozen_policy(cfg, groups, Role.TEACHER, model, cfg.distill.teacher_temperature, device)
    if Role.CRITIC in mine:
        strategy = out.strategies[Role.CRITIC] = _strategy(cfg, groups, Role.CRITIC, device)
        critic: Unfilled = load_critic(
            cfg.model,
            cfg.critic.critic_pretrain,
            cfg.reward.reward_pretrain,
            cfg.train.seed,
            normalize=cfg.algo.normalize_reward,
        )
        if lora is not None:
            critic = add_scalar_adapters(critic, lora, cfg.train.seed)
        model, updater = _updater(
            cfg, critic, strategy, cfg.critic.critic_learning_rate, opt_steps, layout, Role.CRITIC, rank
        )
        out.critic = Critic(
            model,
            updater,
            cfg.critic.value_clip,
            a.loss_agg_mode,
            device,
            packing=cfg.train.packing_samples,
            sp=sequence_parallel(groups, Role.CRITIC, model, cfg.train.packing_samples),
        )
    if Role.REWARD in mine and (reward_pretrain := cfg.reward.reward_pretrain) is not None:
        out.strategies[Role.REWARD] = _strategy(cfg, groups, Role.REWARD, device)
        model = out.strategies[Role.REWARD].wrap(
            load_reward_model(cfg.model, reward_pretrain, cfg.train.seed, normalize=cfg.algo.normalize_reward),
            trainable=False,
        )
        packing = cfg.train.packing_samples
        out.reward_model = RewardModel(
            model, device, packing=packing, sp=sequence_parallel(groups, Role.REWARD, model, packing)
        )
    source = None
    if out.actor and actor_strategy:
        source = (
            ParamSource(out.actor.model, actor_strategy.param_blocks, actor_strategy)
            if lora is None
            else MergedLoraParams(out.actor.model, actor_strategy.param_blocks, lora.scaling)
        )
    out.weight_sync = WeightSync(
        actor_params=source,
        receiver=out.engine.weights if out.engine else None,
        sync_group=groups.get("sync"),
        actor_root=layout.ranks_of(Role.ACTOR)[0],
        colocated=layout.engine_colocated_with_actor,
        bucket_bytes=g.weight_sync_bucket_mb * 2**20,
        wire_dtype=engine_dtype(cfg.model.bf16, device),
        device=device,
        check_names=source.check_names() if isinstance(source, MergedLoraParams) else (),
        together=fused_groups if g.generation_backend == "native" else None,
    )
    if cfg.train.sleep:  # models move off the device between the phases that use them
        out.sleep = sleep_schedule(
            layout,
            rank,
            out,
            device,
            actor_scores=not skips_old_log_probs(cfg.train, cfg.algo, cfg.distill, correction) or cfg.ref_is_actor_base,
        )
    return out


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
    cfg: Config, groups: Groups, role: Role, model: torch.nn.Module, temperature: float, device: torch.device
) -> Reference:
    """The reference's or the teacher's scorer of the wrapped `model` (sequence-parallel when the role is)."""
    return Reference(
        model,
        temperature,
        device,
        packing=cfg.train.packing_samples,
        logits_chunk=cfg.train.logits_chunk_size,
        sp=sequence_parallel(groups, role, model, cfg.train.packing_samples),
        replay=role is Role.REF and cfg.algo.router_replay == "R3",  # the teacher is another model
    )


def sequence_parallel(groups: Groups, role: Role, model: torch.nn.Module, packing: bool) -> SequenceParallel | None:
    """This rank's sequence-parallel group of `role`, with the model's attention switched to Ulysses (None: no SP).
    Packed rows without SP switch it too where the model runs sdpa: each packed sequence then attends by itself."""
    sp = groups.sequence_parallel(role)
    if sp is not None or (packing and ulysses.packs_by_sequence(model)):
        ulysses.enable(model)
    return sp


def _strategy(cfg: Config, groups: Groups, role: Role, device: torch.device) -> Strategy:
    group = groups.role(role)
    assert group is not None, role
    return make_strategy(group, device, cfg.model, cfg.train, groups.solo)


def _updater(
    cfg: Config,
    model: torch.nn.Module | Unfilled,
    strategy: Strategy,
    lr: float,
    total_opt_steps: int,
    layout: Layout,
    role: Role,
    rank: int,
) -> tuple[torch.nn.Module, Updater]:
    """Wrap a trainable model and build its optimizer, schedule and update loop; returns (wrapped model, updater)."""
    t = cfg.train
    model, optimizer = strategy.wrap_trainable(model, lambda m: make_optimizer(m, lr, t.adam_betas, t.l2))
    scheduler = warmup_cosine(optimizer, total_opt_steps, t.lr_warmup_ratio)
    dp_rank, dp_size = layout.data_parallel(role, rank)  # a sequence-parallel group trains one share together
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
