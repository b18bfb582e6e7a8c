"""One training run on this rank: init, build, train, save, always tear down.

Failure policy: a rank that fails prints ONE line (rank, roles, phase, step, error) and leaves
at once with os._exit — it must not wait in a collective or in process-group teardown for peers
that may be gone. Peers then fail fast in their next collective (connection closed) or at the
collective timeout, print a one-line note, and leave the same way; torchrun or srun stops the rest.
"""

from __future__ import annotations

import os
import time

from rlrun.checkpoint.ownership import run_identity
from rlrun.cli.parser import PPO_CLI
from rlrun.compat.openrlhf_init import init_from_openrlhf
from rlrun.compat.openrlhf_init import plan_init as plan_openrlhf_init
from rlrun.config.schema import Config
from rlrun.engines.hosting import choose_host
from rlrun.engines.hosting import describe as describe_host
from rlrun.launch.dist import (collective_device, init_distributed, resolve_dist_backend, resolve_device_and_precision,
                               restart_safety_warning, teardown)
from rlrun.launch.env import DistEnv, read_node_label
from rlrun.launch.failures import check_outputs, fail_and_exit
from rlrun.launch.groups import build_groups
from rlrun.launch.labels import gather_node_labels
from rlrun.launch.layout import Layout, Role
from rlrun.launch.layout_text import format_layout_table, layout_heading
from rlrun.models.loading import load_tokenizer
from rlrun.reporting.metrics import MetricsSink
from rlrun.reporting.run_report import announce, describe_reward, describe_roles, model_form, saved_outputs
from rlrun.rl.build import build_eval_prompts, build_prompts, build_reward_sources, build_roles, make_sampler
from rlrun.rl.evaluation import Evaluator
from rlrun.rl.planning import asks_node_labels, plan
from rlrun.rl.resume import Checkpointer
from rlrun.rl.trainer import Trainer
from rlrun.roles.export import save_critic, save_policy
from rlrun.runtime.deadline import deadline, set_reporter
from rlrun.runtime.errors import DataError
from rlrun.runtime.faults import run_phases
from rlrun.runtime.log import get_logger, quiet_third_party
from rlrun.runtime.memory import report_memory

TABLE_RANKS = 16  # a larger world's layout is one line at start-up (--dry_run prints its table)


def run(cfg: Config, env: DistEnv, layout: Layout, generation_why: str) -> int:
    started = time.monotonic()
    log = get_logger(env.rank)
    quiet_third_party(env.rank)
    roles_text = ",".join(r.value for r in layout.roles_of(env.rank))
    phase = run_phases(env.rank, cfg.runtime.dist_timeout)
    sink = None
    local_only = True  # until the first collective: a failure here is the same on every rank
    # A bound that passes (a hung reward function, a dataset that never loads) ends the run the same way.
    set_reporter(lambda exc: fail_and_exit(log, env.rank, roles_text, phase, exc, cfg.runtime.dist_timeout,
                                           local_only=local_only, sink=sink))
    try:
        device = resolve_device_and_precision(cfg.runtime.device, env.local_rank, cfg.runtime.tf32)
        backend = resolve_dist_backend(cfg.runtime.dist_backend, device, cpu_collectives=cfg.train.reduces_on_cpu)
        tp = cfg.resources.vllm_tensor_parallel_size
        generation = cfg.generation.generation_backend  # resolved before planning (rlrun.engines.choice)
        why = generation_why + (f"; {describe_host(choose_host(cfg.generation.vllm_engine_host, layout, tp), tp)}"
                                if generation == "vllm" else "")
        # Everything that reads local files happens before the first collective, so a bad path fails
        # every rank the same way instead of leaving some waiting.
        tokenizer = load_tokenizer(cfg.model)
        lg = cfg.logging
        evaluates = lg.eval_dataset is not None and (lg.eval_steps > 0 or lg.eval_before_train)
        with deadline(cfg.runtime.data_timeout, lambda: DataError(
                f"loading the prompts (--prompt_data {cfg.data.prompt_data}"
                + (f", --eval_dataset {lg.eval_dataset}" if evaluates else "") + f") took over --data_timeout "
                f"{cfg.runtime.data_timeout:g} s; check the filesystem or network it comes from, or raise --data_timeout")):
            prompts = build_prompts(cfg, tokenizer)
            eval_prompts = build_eval_prompts(cfg, tokenizer) if evaluates else None
        sampler = make_sampler(cfg, prompts)
        total_steps = min(sampler.total_steps, cfg.train.max_steps or sampler.total_steps)
        log.info_once(f"{len(prompts.ids)} prompts ({prompts.truncated} truncated, {prompts.dropped} dropped at "
                      f"--prompt_max_len {cfg.generation.prompt_max_len}), {total_steps} steps, generation backend "
                      f"{generation} ({why}), {backend} on {device.type}")
        sources = build_reward_sources(cfg, layout, env.rank, tokenizer)
        openrlhf_init = (plan_openrlhf_init(cfg.checkpoint.load_openrlhf_checkpoint, run_has_critic=cfg.needs_critic)
                         if cfg.checkpoint.load_openrlhf_checkpoint else None)
        run_id = run_identity()
        if env.rank == 0:  # the writer: a bad output path must fail now, not at the end of training
            check_outputs(cfg.checkpoint, cfg.checkpoint.ckpt_path, run_id, log)
            if not asks_node_labels(cfg):  # else the table follows the labels' placement, below
                log.info_once(_layout_text(layout, env))
            launched = f"world size {env.world_size}, launcher {env.launcher}"
            for line in (describe_reward(cfg),
                         *announce(cfg, PPO_CLI.defaults, PPO_CLI.prog, launched, cfg.checkpoint.ckpt_path)):
                log.info_once(line)
        node_label = read_node_label() if asks_node_labels(cfg) else None
        local_only = False
        if (warning := restart_safety_warning(env)) is not None:
            log.warning_once(warning)
        init_distributed(env, backend, cfg.runtime.dist_timeout, os.path.join(cfg.checkpoint.save_path, "nccl_trace"))
        if node_label is not None:
            # Other nodes' labels are known only now: place the pinned roles before any group or model exists.
            # Every rank plans from the same gathered labels, so an impossible request fails alike everywhere.
            labels = gather_node_labels(node_label, env.local_world_size, collective_device(backend, device))
            local_only = True
            layout = plan(cfg, env.world_size, env.local_world_size, labels).layout
            local_only = False
            roles_text = ",".join(r.value for r in layout.roles_of(env.rank))
            sources = build_reward_sources(cfg, layout, env.rank, tokenizer)  # the engine ranks may have moved
            log.info_once("layout by node label:\n" + format_layout_table(layout))
        phase.phase = "build"
        sync_backend = cfg.generation.vllm_sync_backend if device.type == "cuda" else None
        groups = build_groups(layout, cfg.runtime.dist_timeout, sync_backend,
                              solo=cfg.train.strategy == "deepspeed")
        roles = build_roles(cfg, layout, groups, device, total_steps, tokenizer, sources, prompts.image_processor)
        trainer = Trainer(cfg, layout, groups, roles, prompts, sampler, tokenizer, device, total_steps, phase)
        checkpointer = Checkpointer(cfg, layout, groups, roles, trainer, tokenizer, run_id)
        if openrlhf_init is not None:  # before --load_checkpoint: rlrun's own newer checkpoint wins
            with phase("load", -1):
                log.info_once(init_from_openrlhf(openrlhf_init, roles.actor.model if roles.actor else None,
                                                 roles.critic.model if roles.critic else None))
        if cfg.checkpoint.load_checkpoint:
            with phase("load", -1):
                checkpointer.restore()
        trainer.sync_weights()  # engines start from the actor's (possibly restored) weights
        report_memory(log, "start-up")
        sink = MetricsSink(cfg, total_steps, trainer.state.step) if env.rank == 0 else None

        def after_step(steps_done: int) -> None:
            if checkpointer.should_save(steps_done):
                with phase("save", steps_done - 1):
                    checkpointer.save(steps_done)

        evaluator = None
        if eval_prompts is not None:
            evaluator = Evaluator(cfg, layout, groups, roles, eval_prompts, tokenizer, trainer.comm_device)
            log.info_once(f"evaluating {len(eval_prompts.ids)} prompts x {lg.eval_n_samples_per_prompt} samples "
                          f"(temperature {lg.eval_temperature:g})"
                          + (f" every {lg.eval_steps} steps" if lg.eval_steps > 0 else "")
                          + (" before training" if lg.eval_before_train else ""))
        trainer.fit(sink, after_step, evaluator)  # rank 0's summary (sink.finish, below) reads the metrics it logged
        report_memory(log, "training")
        with phase("save", trainer.state.step):
            allow = cfg.checkpoint.export_nonfinite
            save_policy(roles.actor, tokenizer, cfg.checkpoint.save_path, is_writer=env.rank == 0,
                        strategy=roles.strategies.get(Role.ACTOR), allow_nonfinite=allow,
                        merged=cfg.checkpoint.save_merged,
                        image_processor=prompts.image_processor)
            if cfg.checkpoint.save_value_network and roles.critic is not None:
                first_critic = layout.ranks_of(Role.CRITIC)[0]
                save_critic(roles.critic, os.path.join(cfg.checkpoint.save_path, "critic"), is_writer=env.rank == first_critic,
                            strategy=roles.strategies[Role.CRITIC], allow_nonfinite=allow,
                            merged=cfg.checkpoint.save_merged)
        log.info_once(f"saved the policy {model_form(cfg)} to {cfg.checkpoint.save_path}")
        critic = cfg.checkpoint.save_value_network and roles.critic is not None
        saved = saved_outputs(cfg, cfg.checkpoint.ckpt_path,
                              **({"critic": os.path.join(cfg.checkpoint.save_path, "critic")} if critic else {}))
    except BaseException as exc:  # noqa: BLE001 - every failure ends in the same one-line report
        fail_and_exit(log, env.rank, roles_text, phase, exc, cfg.runtime.dist_timeout, local_only=local_only, sink=sink)
    if sink is not None:
        sink.finish(log, saved, time.monotonic() - started)
    teardown()
    return 0


def _layout_text(layout: Layout, env: DistEnv) -> str:
    head = layout_heading(env)
    if env.world_size <= TABLE_RANKS:
        return f"{head}\n{format_layout_table(layout)}"
    return (f"{head}: {describe_roles({role.value: layout.ranks_of(role) for role in Role if layout.has(role)})}; "
            "--dry_run prints the per-rank table")
