"""rlrun.tinker's trainer for the run skeleton (rlrun.run.skeleton.Trainer): what it reads, what it builds on every
rank (the trained model, an engine beside it, weight sync between them, the request loop) and, on rank 0, the API.

Every rank is an actor rank and an engine rank: the model is FSDP2-sharded over all of them, and each holds an engine
that save_weights_for_sampler fills in place (colocated weight sync; under LoRA the native engine takes the adapters
alone)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from rlrun.checkpoint.checkpointer import Identity, Part
from rlrun.config.fields import redacted
from rlrun.config.generation import GenerationConfig
from rlrun.engines.build import build_engine, engine_adapters, engine_dtype
from rlrun.launch.context import RankContext
from rlrun.launch.env import DistEnv
from rlrun.launch.groups import build_groups
from rlrun.launch.layout import Role, colocated_layout
from rlrun.models.adapter_pretrain import lora_settings
from rlrun.models.loading import (
    load_tokenizer,
    policy_weights,
    response_end_ids,
    trained_policy,
    unfilled_causal_lm,
)
from rlrun.reporting.run_report import model_form, saved_outputs
from rlrun.roles.export import save_causal_lm
from rlrun.roles.update import make_optimizer
from rlrun.run.skeleton import Built, Started
from rlrun.runtime.log import get_logger
from rlrun.strategies.base import ModelState
from rlrun.strategies.choose import make_strategy
from rlrun.tinker.http_api import TinkerHTTPServer, start_server
from rlrun.tinker.job import Serving, Snapshots, Worker
from rlrun.tinker.plan import TinkerPlan
from rlrun.tinker.policy import TrainedPolicy
from rlrun.tinker.sampler import Sampler
from rlrun.tinker.server import Front, Served
from rlrun.weight_sync.sync import policy_weight_sync


@dataclass
class Inputs:
    tokenizer: PreTrainedTokenizerBase
    end_ids: tuple[int, ...]
    server: TinkerHTTPServer | None  # rank 0's, bound in `read` so that a taken port fails before any model loads
    front: Front | None


class TinkerTrainer:
    """The run skeleton's trainer for rlrun.tinker."""

    def memory(self, planned: TinkerPlan, env: DistEnv) -> tuple[list[str], list[str]]:
        return ["rlrun.tinker: no memory plan yet (v1); each rank holds its FSDP shard, Adam's state and an engine"], []

    def preflight(self, planned: TinkerPlan) -> list[str]:
        return [f"the tokenizer of {planned.config.serve.tinker_model_name} loads"] if self._tokenizer(planned) else []

    def _tokenizer(self, planned: TinkerPlan) -> PreTrainedTokenizerBase:
        return load_tokenizer(planned.config.model)

    def read(self, planned: TinkerPlan, started: Started) -> Inputs:
        cfg = planned.config
        tokenizer = self._tokenizer(planned)
        server = front = None
        if started.env.rank == 0:
            s = cfg.serve
            served = Served(
                model_name=s.tinker_model_name or "",
                tokenizer_id=cfg.model.pretrain or "",
                lora_rank=cfg.model.lora_rank,
                arch=planned.arch,
                max_len=cfg.train.max_len,
                ckpt_root=cfg.checkpoint.ckpt_path,
                max_tokens_cap=cfg.sampler.max_tokens_cap,
            )
            front = Front(served, planned.api_key)
            server = start_server(front, s.tinker_host, s.tinker_port, s.tinker_max_request_mb * 2**20)
        return Inputs(tokenizer, response_end_ids(cfg.model, tokenizer), server, front)

    def announce(self, planned: TinkerPlan, inputs: Inputs, env: DistEnv) -> list[str]:
        cfg = planned.config
        assert inputs.server is not None
        host, port = inputs.server.server_address[:2]
        trained = f"LoRA rank {cfg.model.lora_rank}" if cfg.model.lora_rank else "the full model (LoRA rank 0)"
        key = "the --tinker_api_key" if planned.api_key else "any tml- key (set --tinker_api_key to require one)"
        return [
            f"rlrun.tinker: serving {cfg.serve.tinker_model_name} ({trained}) on http://{host!s}:{port}: point the "
            f"tinker SDK there (base_url=, or TINKER_BASE_URL) with {key}; sampling on the {planned.backend} engine"
        ]

    def build(self, planned: TinkerPlan, inputs: Inputs, started: Started) -> Built[Serving]:
        cfg, env = planned.config, started.env
        t, rt = cfg.train, cfg.runtime
        layout = colocated_layout(env.world_size, env.local_world_size)
        groups = build_groups(layout, rt.dist_timeout)
        ctx = RankContext(layout, groups, started.device, t.seed, started.phase, inputs.tokenizer)
        group = groups.role(Role.ACTOR)
        assert group is not None
        generation = GenerationConfig(
            generation_backend=planned.backend,  # type: ignore[arg-type]  # resolved from auto: native | hf
            native_kv_cache_mb=cfg.sampler.native_kv_cache_mb,
            generate_max_len=cfg.sampler.max_tokens_cap,
        )
        weights = policy_weights(cfg.model, t.seed)
        for_engine = unfilled_causal_lm(cfg.model, t.seed, weights)
        for_engine.model.to(engine_dtype(cfg.model.bf16, started.device))  # type: ignore[arg-type]  # meta tensors
        adapters = engine_adapters(cfg.model, generation, 1)
        engine = build_engine(
            ctx,
            generation,
            for_engine,
            inputs.end_ids,
            timeout_s=rt.dist_timeout,
            adapters=adapters,
        )
        strategy = make_strategy(group, started.device, cfg.model, t)
        policy = trained_policy(unfilled_causal_lm(cfg.model, t.seed, weights), cfg.model, t.seed)
        model, optimizer = strategy.wrap_trainable(policy, lambda m: make_optimizer(m, 1e-4, (0.9, 0.95), 0.0))
        sync = policy_weight_sync(ctx, cfg.model, generation, engine, model, strategy, adapters)
        trained = TrainedPolicy(
            model,
            optimizer,
            strategy,
            group,
            started.device,
            started.comm_device,
            t.micro_train_batch_size,
            lora=lora_settings(cfg.model) is not None,
        )
        identity = Identity("tinker", t.strategy, "model", model if env.rank == 0 else None, {})
        parts: list[Part] = [ModelState(strategy, model, optimizer, "model")]
        snapshots = Snapshots(
            cfg.checkpoint,
            identity,
            parts,
            [model],
            redacted(cfg),
            started.run_id,
            groups.world,
            started.comm_device,
            rt.dist_timeout,
        )
        sampler = Sampler(engine, inputs.tokenizer, group, started.comm_device, t.seed)
        worker = Worker(trained, sampler, sync, snapshots, started.phase)
        job = Serving(worker, inputs.front, groups.world, started.comm_device, cfg.serve.tinker_keepalive)
        return Built(job, identity, parts, groups.world, [model])

    def export(self, planned: TinkerPlan, inputs: Inputs, built: Built[Serving]) -> dict[str, str]:
        """When the job stops (SIGTERM, or a preemption notice): the model as trained so far, in Hugging Face format,
        to --save_path (a client saves what it wants during the session with save_state)."""
        if inputs.server is not None:
            inputs.server.shutdown()
            inputs.server.server_close()
        c, policy = planned.config.checkpoint, built.job.worker.policy
        save_causal_lm(
            policy.model,
            inputs.tokenizer,
            c.save_path,
            is_writer=built.job.front is not None,
            strategy=policy.strategy,
            allow_nonfinite=c.export_nonfinite,
            merged=c.save_merged,
        )
        get_logger(torch.distributed.get_rank()).info_once(
            f"saved the model {model_form(planned.config.model, c)} to {c.save_path}"
        )
        return saved_outputs(planned.config.model, c)
