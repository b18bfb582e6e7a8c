"""One training run on this rank: init, build, train, save, always tear down."""

from __future__ import annotations

import os

from rlrun.build import build_prompts, build_roles, make_sampler
from rlrun.config import Config
from rlrun.errors import RlrunError
from rlrun.launch.dist import init_distributed, resolve_backend, resolve_device, teardown
from rlrun.launch.env import DistEnv
from rlrun.launch.groups import build_groups
from rlrun.launch.layout import Layout
from rlrun.log import get_logger
from rlrun.metrics import MetricsSink
from rlrun.models import load_tokenizer
from rlrun.roles.engine import resolve_backend as resolve_generation_backend
from rlrun.save import save_policy
from rlrun.trainer import Trainer


def run(cfg: Config, env: DistEnv, layout: Layout) -> int:
    log = get_logger(env.rank)
    device = resolve_device(cfg.runtime.device, env.local_rank)
    backend = resolve_backend(cfg.runtime.dist_backend, device)
    generation = resolve_generation_backend(cfg.generation.generation_backend, device.type == "cuda")
    # Everything that reads local files happens before the first collective, so a bad path fails
    # every rank the same way instead of leaving some waiting.
    tokenizer = load_tokenizer(cfg)
    prompts = build_prompts(cfg, tokenizer)
    sampler = make_sampler(cfg, prompts)
    total_steps = min(sampler.total_steps, cfg.train.max_steps or sampler.total_steps)
    log.info_once(f"{len(prompts.ids)} prompts ({prompts.truncated} truncated, {prompts.dropped} dropped at "
                  f"--prompt_max_len {cfg.generation.prompt_max_len}), {total_steps} steps, generation backend {generation}, "
                  f"{backend} on {device.type}")
    init_distributed(env, backend, cfg.runtime.dist_timeout, device)
    sink = None
    try:
        sync_backend = cfg.generation.vllm_sync_backend if device.type == "cuda" else None
        groups = build_groups(layout, cfg.runtime.dist_timeout, sync_backend)
        roles = build_roles(cfg, layout, groups, device, total_steps)
        trainer = Trainer(cfg, layout, groups, roles, prompts, sampler, tokenizer, device, total_steps)
        roles.weight_sync.sync()  # engines start from the actor's weights  # type: ignore[union-attr]
        sink = MetricsSink(cfg, total_steps, trainer.state.step) if env.rank == 0 else None
        history = trainer.fit(sink)
        if history:
            log.info_once(f"reward: first step {history[0]['reward']:.3f}, last step {history[-1]['reward']:.3f} "
                          f"({len(history)} steps)")
        save_policy(roles.actor, tokenizer, os.path.join(cfg.checkpoint.save_path), is_writer=env.rank == 0)
        log.info_once(f"saved the policy (Hugging Face format) to {cfg.checkpoint.save_path}")
        return 0
    except RlrunError as exc:
        log.rank_error(str(exc))
        return 1
    finally:
        if sink is not None:
            sink.close()
        teardown()
