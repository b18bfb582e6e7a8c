"""The generation backend a run resolves to, what a vision-language policy cannot do yet, and the MoE options a policy
and its backend cannot run: planning that reads the policy's config.json (transformers), so rlrun.plan.plan imports
it only once the values and the layout hold."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from rlrun.config.tree import Config
from rlrun.engines.build import native_blocker, resolve_backend
from rlrun.engines.protocol import REPORTS_LOG_PROBS
from rlrun.models.architecture import is_vision_language
from rlrun.models.loading import load_model_config
from rlrun.models.moe import MAX_EXPERTS, config_routing_shape
from rlrun.plan.checks import correction_flags
from rlrun.runtime.errors import ConfigError, MissingExtraError

# --dry_run --generation_backend vllm where vLLM is not installed (a login node, CI): planned all the same, since the
# plan needs only the backend's name and its memory model; the real start checks the install (one line if missing).
VLLM_ASSUMED = (
    "vLLM is not installed here: the plan assumes it is on the nodes that run the job (the job itself "
    "refuses to start without it)"
)


@dataclass(frozen=True)
class GenerationChoice:
    """--generation_backend resolved once, before planning, the same on every rank (a pure function of the config,
    the policy's config.json and whether a GPU and vLLM are present), so that planning, building and the rollout
    exchange all read one concrete backend."""

    config: Config  # the run's config with generation_backend set to the chosen backend
    why: str
    assumed: str | None = None  # a dry run planned a backend not installed here: the line that says so

    @property
    def backend(self) -> str:
        return self.config.generation.generation_backend


def choose_generation(cfg: Config, cuda: bool) -> GenerationChoice:
    g = cfg.generation
    try:
        config = load_model_config(cfg.model)
    except ConfigError:
        if not cfg.runtime.dry_run:
            raise
        config = None  # --dry_run on a machine without the model (a login node): paths are only warnings there
    assumed = None
    blocker = None if config is None else native_blocker(config, g.prompt_max_len + g.generate_max_len)
    try:
        backend, why = resolve_backend(g.generation_backend, cuda, blocker)
    except MissingExtraError:
        if not (cfg.runtime.dry_run and g.generation_backend == "vllm"):
            raise
        backend, why, assumed = "vllm", "requested (not installed here)", VLLM_ASSUMED
    if (flags := correction_flags(cfg)) and backend not in REPORTS_LOG_PROBS:
        raise ConfigError(
            f"{flags} needs the engine's sampled-token log-probs, but generation resolved to {backend} ({why}); use "
            "--generation_backend vllm or native, or drop the flag"
        )
    gateway = cfg.agent.gateway_source
    if gateway is not None and backend not in REPORTS_LOG_PROBS:
        raise ConfigError(
            f"{gateway} samples through the token gateway, which answers with each sampled token's log-prob, but "
            f"generation resolved to {backend} ({why}); use --generation_backend native or vllm"
        )
    if config is not None:
        check_moe_options(cfg, config, backend)
    return GenerationChoice(replace(cfg, generation=replace(g, generation_backend=backend)), why, assumed)


def check_aux_loss(coef: float, config: Any, sequence_parallel_size: int) -> None:
    """--aux_loss_coef against the policy (`config`, its HF config) and sequence parallelism (rlrun.ppo's and
    rlrun.sft's): one ConfigError naming the value and what to do."""
    if coef < 0:
        raise ConfigError(f"--aux_loss_coef must be >= 0, got {coef}")
    if coef > 0 and config_routing_shape(config) is None:
        raise ConfigError(
            f"--aux_loss_coef {coef}: the policy ({getattr(config, 'model_type', '?')}) has no MoE layers; drop the "
            "flag (or set it to 0)"
        )
    if coef > 0 and sequence_parallel_size > 1:
        raise ConfigError(
            f"--aux_loss_coef {coef} with --sequence_parallel_size {sequence_parallel_size}: each rank would balance "
            "only its share of the tokens; not supported yet (drop one of them)"
        )


def check_moe_options(cfg: Config, config: Any, backend: str) -> None:
    """--router_replay and --aux_loss_coef against the policy (`config`, its HF config) and the backend: each
    combination rlrun cannot run is one ConfigError naming the values and what to do."""
    a, shape = cfg.algo, config_routing_shape(config)
    dense = f"the policy ({getattr(config, 'model_type', '?')}) has no MoE layers"
    check_aux_loss(a.aux_loss_coef, config, cfg.train.sequence_parallel_size)
    if a.router_replay == "off":
        return
    if shape is None:
        raise ConfigError(f"--router_replay {a.router_replay}: {dense}; drop the flag")
    if shape.experts > MAX_EXPERTS:
        raise ConfigError(
            f"--router_replay {a.router_replay}: {shape.experts} experts do not fit rlrun's uint8 routing (at most "
            f"{MAX_EXPERTS})"
        )
    if a.router_replay == "R2":
        if cfg.train.sequence_parallel_size > 1:
            raise ConfigError(
                f"--router_replay R2 with --sequence_parallel_size {cfg.train.sequence_parallel_size}: each rank's "
                "scoring pass routes only its columns, which rlrun does not gather yet; use R3 or drop one of them"
            )
        return
    if backend == "vllm":
        raise ConfigError(
            "--router_replay R3 needs the engine to report each token's experts: rlrun's vLLM adapter does not read "
            "them yet; use --generation_backend native or hf"
        )
    if cfg.train.continues_rollouts:
        raise ConfigError(
            "--router_replay R3 with --partial_rollout: a continued response's tokens were routed by several policy "
            "versions, which rlrun does not record yet; drop one of them"
        )
    if cfg.agent.multi_turn:
        raise ConfigError(
            "--router_replay R3 with multi-turn agents is not supported yet: the environment's tokens "
            "are never routed by the engine; drop one of them"
        )


# ---- vision-language runs ----------------------------------------------------------------------------------------
# What a run with a vision-language policy can do today, checked before launch: each unsupported combination is
# one ConfigError with the reason and what to do instead.


def vision_run_problem(cfg: Config) -> str | None:
    """Why this run cannot train its vision-language policy (None: it can, or the policy is text-only)."""
    try:
        config = load_model_config(cfg.model)
    except ConfigError:
        return None  # a --dry_run without the model here: planning says so
    if not is_vision_language(config):
        return None
    if cfg.generation.generation_backend == "vllm" and cfg.resources.vllm_tensor_parallel_size > 1:
        return (
            "tensor-parallel vLLM engines (their ranks exchange prompts as text; use --vllm_tensor_parallel_size "
            "1, "
            "more engines instead)"
        )
    if cfg.agent.multi_turn:
        return "multi-turn agents (their observations are text; episodes with images are not built yet)"
    if cfg.train.partial_rollout:
        return "--partial_rollout (its pool carries text rows only; use --async_train alone)"
    if cfg.algo.needs_critic:
        return (
            "a critic (PPO's GAE; no value head runs on a vision-language model yet: use a critic-free estimator, "
            "e.g. --advantage_estimator group_norm)"
        )
    if cfg.reward.needs_reward_model:
        return "--reward_pretrain (reward models read text only; use --remote_rm_url or --compute_score)"
    if cfg.model.lora_rank > 0:
        return "--lora_rank (adapters on a vision-language model are not wired yet; train every weight)"
    if cfg.distill.teacher_pretrain is not None:
        return "--teacher_pretrain (the teacher's forward takes no images yet)"
    return None


def check_vision_run(cfg: Config) -> None:
    if (problem := vision_run_problem(cfg)) is not None:
        raise ConfigError(
            f"--pretrain {cfg.model.pretrain} is a vision-language model, and rlrun does not yet run it with {problem}"
        )
