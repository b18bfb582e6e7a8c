"""What a run with a vision-language policy can do today, checked before launch: each unsupported combination is
one ConfigError with the reason and what to do instead."""

from __future__ import annotations

from rlrun.config.schema import Config
from rlrun.models.architecture import is_vision_language
from rlrun.models.loading import load_model_config
from rlrun.runtime.errors import ConfigError


def vision_run_problem(cfg: Config) -> str | None:
    """Why this run cannot train its vision-language policy (None: it can, or the policy is text-only)."""
    try:
        config = load_model_config(cfg.model)
    except ConfigError:
        return None  # a --dry_run without the model here: planning says so
    if not is_vision_language(config):
        return None
    if cfg.generation.generation_backend == "vllm" and cfg.resources.vllm_tensor_parallel_size > 1:
        return ("tensor-parallel vLLM engines (their ranks exchange prompts as text; use --vllm_tensor_parallel_size 1, "
                "more engines instead)")
    if cfg.multi_turn:
        return "multi-turn agents (their observations are text; episodes with images are not built yet)"
    if cfg.train.partial_rollout:
        return "--partial_rollout (its pool carries text rows only; use --async_train alone)"
    if cfg.needs_critic:
        return "a critic (PPO's GAE; no value head runs on a vision-language model yet: use a critic-free estimator, e.g. --advantage_estimator group_norm)"
    if cfg.needs_reward_model:
        return "--reward_pretrain (reward models read text only; use --remote_rm_url or --compute_score)"
    if cfg.model.lora_rank > 0:
        return "--lora_rank (adapters on a vision-language model are not wired yet; train every weight)"
    return None


def check_vision_run(cfg: Config) -> None:
    if (problem := vision_run_problem(cfg)) is not None:
        raise ConfigError(f"--pretrain {cfg.model.pretrain} is a vision-language model, and rlrun does not yet run it "
                          f"with {problem}")
