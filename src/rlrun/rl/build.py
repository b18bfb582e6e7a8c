"""Build what this rank needs for its roles: prompts, models, strategies, roles, weight sync."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from rlrun.agents.episodes import EpisodeRunner
from rlrun.agents.from_config import build_episode_runner
from rlrun.algo.is_correction import ISCorrection
from rlrun.config.schema import Config
from rlrun.data.prompts import (PromptKeys, PromptRecord, PromptSampler, format_prompt, load_prompt_records,
                                tokenize_prompts)
from rlrun.data.sources import DataSpec
from rlrun.data.vision_batch import PromptVision, RowVision
from rlrun.engines.base import HFEngine, SamplingSettings
from rlrun.engines.decoder import fused_groups
from rlrun.engines.native import NativeEngine
from rlrun.launch.dist import before_teardown, world_size
from rlrun.launch.groups import Groups
from rlrun.launch.layout import Layout, Role
from rlrun.launch.transfer import EngineRowExchange
from rlrun.launch.weight_sync import ParamSource, WeightSync
from rlrun.models.adapter_pretrain import lora_settings
from rlrun.models.architecture import is_vision_language
from rlrun.models.loading import (load_critic, load_model_config, load_reward_model, model_folder, policy_weights,
                                  trained_policy, unfilled_causal_lm)
from rlrun.models.lora import add_scalar_adapters
from rlrun.strategies.lora_params import MergedLoraParams
from rlrun.models.weights import Unfilled
from rlrun.rewards.compute_score import load_compute_score_function
from rlrun.rewards.reward_fn import PromptMeta, RewardFunction, load_reward_function
from rlrun.roles.actor import Actor, PolicyLossSettings
from rlrun.roles.critic import Critic
from rlrun.roles.optim import make_optimizer, warmup_cosine
from rlrun.roles.reference import Reference
from rlrun.roles.reward_model import RewardModel
from rlrun.roles.update import Updater
from rlrun.runtime.errors import DataError
from rlrun.runtime.log import get_logger
from rlrun.strategies.base import Strategy
from rlrun.strategies.choose import make_strategy
from rlrun.vision.processor import ImageInputs
from rlrun.vision.positions import quiet_output_view_warning
from rlrun.vision.tower import freeze_by_prefix, freeze_vision_tower

if TYPE_CHECKING:
    from rlrun.engines.in_process import InProcessEngine
    from rlrun.engines.tensor_parallel import TensorParallelEngine
    from rlrun.engines.vllm_engine import VLLMEngine


@dataclass
class Prompts:
    """The prompt set after formatting and tokenising; index i is record i."""

    texts: list[str]
    ids: list[list[int]]
    records: list[PromptRecord]  # the label, data source and extra info each reward source may read
    truncated: int
    dropped: int
    images: ImageInputs | None = None  # a vision-language policy's image preprocessing (used where it generates)

    @property
    def labels(self) -> list[Any]:
        return [r.label for r in self.records]

    @property
    def image_processor(self) -> Any:
        """A vision-language policy's image processor (saved beside its HF exports), None for a text policy."""
        return None if self.images is None else self.images.processor

    def meta(self, indices: list[int]) -> PromptMeta:
        rows = [self.records[i] for i in indices]
        return PromptMeta([r.label for r in rows], [r.data_source for r in rows], [r.extra_info for r in rows])

    def with_images(self, indices: list[int], prompt_max_len: int) -> tuple[list[list[int]], RowVision]:
        """A vision-language policy's rows of records `indices`: prompt ids with each image token expanded by the
        image processor, and the rows' images (each record's read once, however many rows it has)."""
        assert self.images is not None
        done: dict[int, tuple[list[int], PromptVision]] = {}
        for i in indices:
            if i not in done:
                record, where = self.records[i], f"prompt record {i}"
                done[i] = self.images.prepare(self.ids[i], record.images, where, record.base_dir)
                if len(done[i][0]) > prompt_max_len:
                    raise DataError(f"{where} has {len(done[i][0])} tokens with its images' tokens, more than "
                                    f"--prompt_max_len {prompt_max_len} (images are never cut); raise --prompt_max_len "
                                    "or lower --max_pixels")
        return [done[i][0] for i in indices], RowVision.of_rows([done[i][1] for i in indices])


@dataclass
class RankRoles:
    """The roles this rank plays (None where it plays none)."""

    actor: Actor | None = None
    critic: Critic | None = None
    reference: Reference | None = None
    reward_model: RewardModel | None = None
    reward_fn: RewardFunction | None = None
    agents: EpisodeRunner | None = None  # multi-turn episodes (their rewards replace reward_fn)
    engine: "HFEngine | NativeEngine | VLLMEngine | TensorParallelEngine | InProcessEngine | None" = None
    weight_sync: WeightSync | None = None
    strategies: dict[Role, Strategy] = field(default_factory=dict)  # of the roles above that hold a model


def build_prompts(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> Prompts:
    return prompt_set(cfg, tokenizer, prompt_spec(cfg))


def build_eval_prompts(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> Prompts:
    """--eval_dataset, read, formatted and cut like the training prompts (--max_samples too, as OpenRLHF does)."""
    assert cfg.logging.eval_dataset is not None
    prompts = prompt_set(cfg, tokenizer, eval_spec(cfg))
    if not prompts.ids:
        raise DataError(f"every prompt of --eval_dataset {cfg.logging.eval_dataset} is longer than --prompt_max_len "
                        f"{cfg.generation.prompt_max_len} and was dropped (--prompt_overflow drop); raise "
                        "--prompt_max_len or use --prompt_overflow truncate")
    return prompts


def prompt_keys(cfg: Config) -> PromptKeys:
    d = cfg.data
    return PromptKeys(d.input_key, d.label_key, d.data_source_key)


def prompt_spec(cfg: Config) -> DataSpec | None:
    """--prompt_data's sources (None: the built-in prompts)."""
    d = cfg.data
    return None if d.prompt_data is None else DataSpec(d.prompt_data, "prompt_data", d.prompt_split, d.prompt_data_probs,
                                                       cfg.train.seed)


def eval_spec(cfg: Config) -> DataSpec | None:
    e = cfg.logging
    return None if e.eval_dataset is None else DataSpec(e.eval_dataset, "eval_dataset", e.eval_split, seed=cfg.train.seed)


def prompt_set(cfg: Config, tokenizer: PreTrainedTokenizerBase, spec: DataSpec | None) -> Prompts:
    d = cfg.data
    records = load_prompt_records(spec, prompt_keys(cfg), cfg.train.max_samples)
    source = spec.sources if spec is not None else "<built-in prompts>"
    texts = [format_prompt(r.prompt, tokenizer, d.input_template, d.apply_chat_template, d.apply_chat_template_kwargs,
                           where=f"{source}: record {i}") for i, r in enumerate(records)]
    images = image_inputs(cfg, records, source)
    max_len = cfg.generation.prompt_max_len
    if cfg.generation.prompt_overflow == "drop":
        full, _ = tokenize_prompts(texts, tokenizer, 10**12)
        keep = [i for i, ids in enumerate(full) if len(ids) <= max_len]
        return Prompts([texts[i] for i in keep], [full[i] for i in keep], [records[i] for i in keep], 0,
                       len(texts) - len(keep), images)
    ids, truncated = tokenize_prompts(texts, tokenizer, max_len)
    return Prompts(texts, ids, records, truncated, 0, images)


def image_inputs(cfg: Config, records: list[PromptRecord], source: str) -> ImageInputs | None:
    """The image preprocessing of a vision-language policy (None for a text policy, whose prompts must hold no
    images: they would be dropped without a word)."""
    config = load_model_config(cfg.model)
    if is_vision_language(config):
        d = cfg.data
        most = d.max_images_per_prompt
        over = next((i for i, r in enumerate(records) if most > 0 and len(r.images) > most), None)
        if over is not None:
            raise DataError(f"{source}: record {over} has {len(records[over].images)} images, more than "
                            f"--max_images_per_prompt {most}; raise it (0: no limit) or drop the record")
        return ImageInputs(model_folder(cfg.model.pretrain, "pretrain"), config, d.min_pixels, d.max_pixels)
    with_images = next((i for i, r in enumerate(records) if r.images), None)
    if with_images is not None:
        raise DataError(f"{source}: record {with_images} has images, but the policy "
                        f"{cfg.model.pretrain or cfg.model.model_preset} is a text-only model; use a vision-language "
                        "model (e.g. Qwen2.5-VL) or text-only prompts")
    return None


def make_sampler(cfg: Config, prompts: Prompts) -> PromptSampler:
    kept, batch = len(prompts.ids), cfg.train.rollout_batch_size
    if prompts.dropped and kept < batch:
        raise DataError(f"{prompts.dropped} of {prompts.dropped + kept} prompts are longer than --prompt_max_len "
                        f"{cfg.generation.prompt_max_len} and were dropped (--prompt_overflow drop); the {kept} left "
                        f"do not fill one --rollout_batch_size {batch}. Raise --prompt_max_len, use --prompt_overflow "
                        "truncate, or lower --rollout_batch_size.")
    return PromptSampler(len(prompts.ids), cfg.train.rollout_batch_size, cfg.train.seed, cfg.train.num_episodes)


def optimizer_steps(cfg: Config, total_steps: int) -> int:
    return total_steps * cfg.train.max_epochs * (cfg.rollouts_per_step // cfg.train.train_batch_size)


def engine_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    return torch.bfloat16 if cfg.model.bf16 and device.type == "cuda" else torch.float32


def _strategy(cfg: Config, groups: Groups, role: Role, device: torch.device) -> Strategy:
    group = groups.role(role)
    assert group is not None, role
    return make_strategy(group, device, cfg.model, cfg.train, groups.solo)


def _updater(cfg: Config, model: torch.nn.Module, strategy: Strategy, lr: float, total_opt_steps: int,
             layout: Layout, role: Role, rank: int) -> tuple[torch.nn.Module, Updater]:
    """Wrap a trainable model and build its optimizer, schedule and update loop; returns (wrapped model, updater)."""
    t = cfg.train
    model, optimizer = strategy.wrap_trainable(model, lambda m: make_optimizer(m, lr, t.adam_betas, t.l2))
    scheduler = warmup_cosine(optimizer, total_opt_steps, t.lr_warmup_ratio)
    ranks = layout.ranks_of(role)
    return model, Updater(model, strategy, optimizer, scheduler, t.max_norm, t.micro_train_batch_size, ranks.index(rank),
                          len(ranks), max_nonfinite_in_a_row=t.max_skipped_steps, ops=strategy.step_ops(model))


@dataclass
class RewardSources:
    """What rewards an engine rank's rollouts: a reward function, or agents whose episodes carry rewards."""

    reward_fn: RewardFunction | None = None
    agents: EpisodeRunner | None = None


def build_reward_sources(cfg: Config, layout: Layout, rank: int, tokenizer: PreTrainedTokenizerBase) -> RewardSources:
    """The rollout reward source of an engine rank (nothing elsewhere, or when a reward model scores). Imports
    a reward or agent file but contacts no server, so run() calls it before the first collective."""
    if Role.ENGINE not in layout.roles_of(rank) or cfg.needs_reward_model:
        return RewardSources()
    if cfg.multi_turn:
        return RewardSources(agents=build_episode_runner(cfg, tokenizer))
    m = cfg.model
    if m.compute_score is not None:
        return RewardSources(reward_fn=load_compute_score_function(
            m.compute_score, m.compute_score_name, workers=reward_workers(cfg, layout), call_timeout_s=cfg.reward_call_timeout))
    return RewardSources(reward_fn=load_reward_function(m.remote_rm_url, timeout_s=m.remote_rm_timeout,
                                                        retries=m.remote_rm_retries, call_timeout_s=cfg.reward_call_timeout))


def reward_workers(cfg: Config, layout: Layout) -> int:
    """--reward_workers, or up to 8 processes per rank sharing the node's cores with its other ranks."""
    if cfg.model.reward_workers is not None:
        return cfg.model.reward_workers
    return max(1, min(8, (os.cpu_count() or 1) // max(1, layout.ranks_per_node)))


def _policies(cfg: Config, count: int, rank: int) -> Iterator[Unfilled]:
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


def _vllm_images(cfg: Config, image_processor: Any) -> dict[str, Any]:
    """A vision-language policy's image processor for the vLLM engine (which preprocesses the images itself, with
    rlrun's resize bounds) and its per-prompt image limit; {} for a text policy (image_processor None)."""
    if image_processor is None:
        return {}
    return {"image_processor": image_processor, "images_per_prompt": max(1, cfg.data.max_images_per_prompt)}


def _vllm_engine(cfg: Config, layout: Layout, groups: Groups, unfilled: Unfilled, tokenizer: PreTrainedTokenizerBase,
                 sampling: SamplingSettings, device: torch.device, image_processor: Any = None
                 ) -> "VLLMEngine | TensorParallelEngine | InProcessEngine":
    """vLLM in this rank when the engine ranks are the whole world (engines/hosting.py); otherwise a vLLM child on
    this rank (tensor parallel 1), or this rank's part of a tensor-parallel engine whose child runs on the engine's
    first rank. `unfilled`: the policy in the engine's dtype, on the meta device. Weight sync hands each sync to
    vLLM and the rank reads nothing (but a vision-language policy, for vLLM's first file, into host memory and
    dropped once written)."""
    from rlrun.engines.hosting import choose_host  # noqa: PLC0415 - optional extra
    from rlrun.engines.tensor_parallel import TensorParallelEngine  # noqa: PLC0415
    from rlrun.engines.vllm_engine import VLLMEngine  # noqa: PLC0415

    g, rank = cfg.generation, groups.rank
    tp = cfg.resources.vllm_tensor_parallel_size
    index = layout.engine_index_of(rank)
    assert index is not None
    engine_group = groups.get(f"engine.{index}")
    assert engine_group is not None
    exchange = EngineRowExchange(engine_group, device)
    max_model_len = g.prompt_max_len + g.generate_max_len
    if g.vllm_enable_sleep and device.type != "cuda" and rank == layout.ranks_of(Role.ENGINE)[0]:
        get_logger(rank)._emit("info", "--vllm_enable_sleep: no effect on CPU (vLLM has no sleep mode there); the "
                                       "engines stay awake")
    in_process = choose_host(g.vllm_engine_host, layout, tp) == "in_process"
    # Weight sync hands every sync straight to vLLM (the gathered tensors in-process, a stream of buckets to a child):
    # the rank keeps no copy of the policy. A vision-language policy is read for vLLM's first file, and dropped.
    if image_processor is not None and (in_process or exchange.is_leader):
        policy = unfilled.fill(torch.device("cpu"))
    else:
        policy = unfilled.model
    if in_process:
        from rlrun.engines.in_process import InProcessEngine  # noqa: PLC0415

        engine = InProcessEngine(policy, tokenizer, sampling, device, layout=layout, world_size=world_size(), rank=rank,
                                 exchange=exchange, seed=cfg.train.seed, max_model_len=max_model_len,
                                 tensor_parallel_size=tp, enforce_eager=g.enforce_eager,
                                 gpu_memory_utilization=g.vllm_gpu_memory_utilization, enable_sleep=g.vllm_enable_sleep,
                                 kv_cache_memory_bytes=g.vllm_kv_cache_memory_bytes,
                                 seeded_requests=g.vllm_seeded_requests, **_vllm_images(cfg, image_processor))
        before_teardown(engine.close)  # vLLM's groups go before the default group
        return engine
    leader = None
    if exchange.is_leader:
        leader = VLLMEngine(policy, tokenizer, sampling, device, seed=cfg.train.seed,
                            max_model_len=max_model_len, timeout_s=cfg.runtime.dist_timeout,
                            enforce_eager=g.enforce_eager, gpu_memory_utilization=g.vllm_gpu_memory_utilization,
                            rank=rank, tensor_parallel_size=tp, enable_sleep=g.vllm_enable_sleep,
                            kv_cache_memory_bytes=g.vllm_kv_cache_memory_bytes, seeded_requests=g.vllm_seeded_requests,
                            **_vllm_images(cfg, image_processor))
    if tp == 1:
        assert leader is not None
        return leader
    return TensorParallelEngine(policy, sampling, exchange, leader)


def build_roles(cfg: Config, layout: Layout, groups: Groups, device: torch.device, total_steps: int,
                tokenizer: PreTrainedTokenizerBase, sources: RewardSources, image_processor: Any = None) -> RankRoles:
    """`image_processor`: a vision-language policy's (Prompts.image_processor), None for a text policy."""
    rank = groups.rank
    mine = set(layout.roles_of(rank))
    out = RankRoles()
    opt_steps = optimizer_steps(cfg, total_steps)
    a, g = cfg.algo, cfg.generation
    actor_strategy = None
    lora = lora_settings(cfg.model)  # adapters on the trained models (actor, critic); engines get merged weights
    if image_processor is not None:
        quiet_output_view_warning()
    policies = _policies(cfg, sum(r in mine for r in (Role.ACTOR, Role.REF, Role.ENGINE)), rank)
    if Role.ENGINE in mine:
        # Engines first: vLLM sizes its KV cache from the device memory free when it starts (and refuses a
        # --vllm_gpu_memory_utilization share that is not free), so it must start before the training models
        # claim theirs. Every rank builds in this same role order, so the groups' collectives cannot interleave.
        sampling = SamplingSettings(g.temperature, g.top_p, g.generate_max_len, int(tokenizer.pad_token_id),
                                    int(tokenizer.eos_token_id))
        unfilled = next(policies)
        unfilled.model.to(engine_dtype(cfg, device))  # on the meta device: the weights are read in this dtype
        if g.generation_backend == "vllm":  # run.py's resolve_backend already checked version and layout
            out.engine = _vllm_engine(cfg, layout, groups, unfilled, tokenizer, sampling, device, image_processor)
        elif g.generation_backend == "native":  # run.py resolved `auto` and checked the architecture
            policy = unfilled.fill(device)
            budget = None if g.native_kv_cache_mb is None else g.native_kv_cache_mb * 2**20
            out.engine = NativeEngine(policy, sampling, device, tokenizer, kv_cache_bytes=budget,
                                      cuda_graph=g.native_cuda_graph)
        else:
            out.engine = HFEngine(unfilled.fill(device), sampling, device, tokenizer)
        out.reward_fn, out.agents = sources.reward_fn, sources.agents
    if Role.ACTOR in mine:
        actor_strategy = out.strategies[Role.ACTOR] = _strategy(cfg, groups, Role.ACTOR, device)
        eps_low, eps_high = a.eps_clip_low_high or (a.eps_clip, a.eps_clip)
        settings = PolicyLossSettings(eps_low, a.dual_clip, a.loss_agg_mode, g.temperature, a.entropy_loss_coef,
                                      a.use_kl_loss, a.kl_estimator, eps_clip_high=eps_high,
                                      loss_type=a.policy_loss_type,
                                      is_correction=ISCorrection(a.is_correction_level, a.is_correction_mode,
                                                                 a.is_correction_gating, *a.is_correction_threshold))
        policy = trained_policy(next(policies), cfg.model, cfg.train.seed)
        if cfg.model.freeze_visual_encoder:
            freeze_vision_tower(policy.model)
        if cfg.model.freeze_prefix:
            freeze_by_prefix(policy.model, cfg.model.freeze_prefix)
        model, updater = _updater(cfg, policy, actor_strategy, cfg.train.actor_learning_rate, opt_steps, layout,
                                  Role.ACTOR, rank)
        out.actor = Actor(model, updater, settings, device, packing=cfg.train.packing_samples,
                          logits_chunk=cfg.train.logits_chunk_size)
        if cfg.ref_is_actor_base:  # the layout has no reference ranks: the actor's base scores for it
            out.reference = Reference(model, g.temperature, device, packing=cfg.train.packing_samples,
                                      logits_chunk=cfg.train.logits_chunk_size, adapters_off=True)
    if Role.REF in mine:
        out.strategies[Role.REF] = _strategy(cfg, groups, Role.REF, device)
        model = out.strategies[Role.REF].wrap(next(policies), trainable=False)
        out.reference = Reference(model, g.temperature, device, packing=cfg.train.packing_samples,
                                  logits_chunk=cfg.train.logits_chunk_size)
    if Role.CRITIC in mine:
        strategy = out.strategies[Role.CRITIC] = _strategy(cfg, groups, Role.CRITIC, device)
        critic = load_critic(cfg) if lora is None else add_scalar_adapters(load_critic(cfg), lora, cfg.train.seed)
        model, updater = _updater(cfg, critic, strategy, cfg.train.critic_learning_rate, opt_steps, layout,
                                  Role.CRITIC, rank)
        out.critic = Critic(model, updater, a.value_clip, a.loss_agg_mode, device, packing=cfg.train.packing_samples)
    if Role.REWARD in mine:
        out.strategies[Role.REWARD] = _strategy(cfg, groups, Role.REWARD, device)
        model = out.strategies[Role.REWARD].wrap(load_reward_model(cfg), trainable=False)
        out.reward_model = RewardModel(model, device, packing=cfg.train.packing_samples)
    source = None
    if out.actor and actor_strategy:
        source = ParamSource(out.actor.model, actor_strategy.param_blocks, actor_strategy) if lora is None else \
            MergedLoraParams(out.actor.model, actor_strategy.param_blocks, lora.scaling)
    out.weight_sync = WeightSync(
        actor_params=source,
        engine_model=out.engine.model if out.engine else None,
        sink=out.engine.sink if out.engine else None,
        loader=out.engine.loader if out.engine else None,
        sync_group=groups.get("sync"),
        actor_root=layout.ranks_of(Role.ACTOR)[0],
        colocated=layout.engine_colocated_with_actor,
        bucket_bytes=g.weight_sync_bucket_mb * 2**20,
        wire_dtype=engine_dtype(cfg, device),
        device=device,
        check_names=source.check_names() if isinstance(source, MergedLoraParams) else (),
        together=fused_groups if g.generation_backend == "native" else None,
    )
    return out
