"""Value checks that run before any process group, model or dataset is touched.

Every message names the offending flag, its value and what would fix it.
"""

from __future__ import annotations

import importlib.util
import os
from importlib.metadata import PackageNotFoundError, version

from rlrun.algo.policy_losses import PolicyLossParams, check_params
from rlrun.algo.rollout_correction import (
    RolloutCorrection,
    check_openrlhf,
    openrlhf_correction,
    preset,
    verl_correction,
)
from rlrun.config.agent import RETRIEVER_RETRY_BACKOFF_S
from rlrun.config.algorithm import NEEDS_GROUPS, AlgorithmConfig
from rlrun.config.checkpoint import SavingConfig
from rlrun.config.model import PretrainedConfig
from rlrun.config.supervised import DPOConfig, DPOLossConfig, SupervisedConfig
from rlrun.config.training import OptimConfig
from rlrun.config.tree import Config
from rlrun.launch.layout import Layout, Role
from rlrun.models.lora import ADAPTER_CONFIG, refuse_adapter_as_reference
from rlrun.runtime.errors import ConfigError

# The file that marks a PEFT adapter directory (models/lora.py reads it; here: --pretrain may be one).


def _positive(name: str, value: int | float | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"--{name} must be > 0, got {value}")


def check_model_settings(model: PretrainedConfig) -> None:
    """The model section's rules, shared by rlrun.ppo and the supervised trainers."""
    if model.flash_attn and not model.bf16:
        raise ConfigError(
            "--flash_attn needs --bf16: flash-attention 2 runs only in half precision (its kernel "
            "refuses fp32 inputs); add --bf16, or drop --flash_attn for PyTorch's SDPA"
        )


def check_lora_settings(model: PretrainedConfig, saving: SavingConfig) -> None:
    """--lora_rank and its companions, shared by rlrun.ppo and the supervised trainers: caught here rather than by
    PEFT mid-build, or (all-linear beside module names, which PEFT reads as one more name) never."""
    rank = model.lora_rank
    if rank < 0:
        raise ConfigError(f"--lora_rank must be >= 0 (0: train every weight; LoRA: e.g. 8, 16 or 64), got {rank}")
    if rank > 0 and model.lora_alpha <= 0:
        raise ConfigError(
            f"--lora_alpha must be > 0 with --lora_rank {rank} (the adapters' update is scaled by alpha "
            f"/ rank; OpenRLHF's and verl's default is 16), got {model.lora_alpha}"
        )
    if not 0 <= model.lora_dropout < 1:
        raise ConfigError(
            f"--lora_dropout must be in [0, 1) (the chance of zeroing an adapter input), got {model.lora_dropout}"
        )
    targets = list(model.target_modules)
    if any(not name.strip() for name in targets):
        raise ConfigError(
            f"--target_modules {targets} has an empty module name (a stray comma?); give names like "
            "q_proj v_proj, or all-linear"
        )
    if "all-linear" in targets and len(targets) > 1:
        raise ConfigError(
            f"--target_modules {' '.join(targets)}: all-linear (every linear layer but the output head) "
            "stands alone; give it alone, or only module names"
        )
    # A saved adapter directory as --pretrain trains LoRA without --lora_rank (its adapter_config.json says the rank).
    adapter = model.pretrain is not None and os.path.isfile(os.path.join(model.pretrain, ADAPTER_CONFIG))
    if saving.save_merged and rank == 0 and not adapter:
        raise ConfigError(
            "--save_merged writes the base model with the LoRA adapters merged in, and this run has no "
            "adapters: add --lora_rank N (e.g. 16), or drop --save_merged (without LoRA --save_path "
            "holds the full model already)"
        )


def check_values(cfg: Config) -> None:
    """Ranges and cross-field rules that need no layout."""
    t, a, g = cfg.train, cfg.algo, cfg.generation
    check_model_settings(cfg.model)
    check_lora_settings(cfg.model, cfg.checkpoint)
    for name in (
        "rollout_batch_size",
        "micro_rollout_batch_size",
        "train_batch_size",
        "micro_train_batch_size",
        "n_samples_per_prompt",
        "max_epochs",
        "num_episodes",
        "max_samples",
    ):
        _positive(name, getattr(t, name))
    _positive("max_steps", t.max_steps, allow_none=True)
    _positive("native_kv_cache_mb", g.native_kv_cache_mb, allow_none=True)
    for name in ("prompt_max_len", "generate_max_len", "weight_sync_bucket_mb"):
        _positive(name, getattr(g, name))
    for name in ("actor_learning_rate", "critic_learning_rate"):
        if getattr(t, name) < 0:
            raise ConfigError(f"--{name} must be >= 0, got {getattr(t, name)}")
    if not 0 <= t.lr_warmup_ratio <= 1:
        raise ConfigError(f"--lr_warmup_ratio must be in [0, 1], got {t.lr_warmup_ratio}")
    if t.max_norm < 0 or t.l2 < 0:
        raise ConfigError(f"--max_norm and --l2 must be >= 0, got {t.max_norm} and {t.l2}")
    if t.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--zero_stage must be 0, 1, 2 or 3, got {t.zero_stage}")
    if t.deepspeed_enable_sleep and t.strategy == "deepspeed" and t.zero_stage == 3:
        raise ConfigError(
            "--deepspeed_enable_sleep with --strategy deepspeed --zero_stage 3 is not supported (rlrun's "
            "DeepSpeed strategy runs ZeRO-0/1/2; DeepSpeed's own ZeRO-3 offload_states needs FusedAdam "
            "on CUDA); use --zero_stage 1 or 2, or --strategy fsdp --zero_stage 3"
        )
    if g.temperature <= 0:
        raise ConfigError(f"--temperature must be > 0, got {g.temperature}")
    if not 0 < g.top_p <= 1:
        raise ConfigError(f"--top_p must be in (0, 1], got {g.top_p}")
    if not 0 < g.vllm_gpu_memory_utilization <= 1:
        raise ConfigError(f"--vllm_gpu_memory_utilization must be in (0, 1], got {g.vllm_gpu_memory_utilization}")
    if g.vllm_kv_cache_memory_bytes is not None and g.vllm_kv_cache_memory_bytes <= 0:
        raise ConfigError(f"--vllm_kv_cache_memory_bytes must be > 0 bytes, got {g.vllm_kv_cache_memory_bytes}")
    _positive("eps_clip", a.eps_clip)
    if a.value_clip is not None and a.value_clip <= 0:
        raise ConfigError(f"--value_clip must be > 0 (or unset), got {a.value_clip}")
    if not 0 <= a.gamma <= 1 or not 0 <= a.lambd <= 1:
        raise ConfigError(f"--gamma and --lambd must be in [0, 1], got {a.gamma} and {a.lambd}")
    if a.init_kl_coef < 0:
        raise ConfigError(f"--init_kl_coef must be >= 0, got {a.init_kl_coef}")
    _positive("kl_target", a.kl_target, allow_none=True)
    _positive("kl_horizon", a.kl_horizon)
    low, high = a.reward_clip_range
    if low >= high:
        raise ConfigError(f"--reward_clip_range needs low < high, got {low} {high}")
    if a.entropy_loss_coef is not None and a.entropy_loss_coef < 0:
        raise ConfigError(f"--entropy_loss_coef must be >= 0, got {a.entropy_loss_coef}")
    if a.advantage_estimator in NEEDS_GROUPS and t.n_samples_per_prompt < 2:
        raise ConfigError(
            f"--advantage_estimator {a.advantage_estimator} compares samples of the same prompt and needs "
            f"--n_samples_per_prompt >= 2, got {t.n_samples_per_prompt}"
        )
    _check_algorithm_extras(cfg)
    _check_dynamic_batch(cfg)
    _check_partial_rollout(cfg)
    _check_agent(cfg)
    if cfg.data.input_template is not None and "{}" not in cfg.data.input_template:
        raise ConfigError(
            f"--input_template must contain '{{}}' where the prompt goes, got {cfg.data.input_template!r}"
        )
    if cfg.checkpoint.save_steps == 0 or cfg.checkpoint.save_steps < -1:
        raise ConfigError(
            f"--save_steps must be a positive number of steps or -1 (never), got {cfg.checkpoint.save_steps}"
        )
    _positive("max_ckpt_num", cfg.checkpoint.max_ckpt_num)
    _positive("logging_steps", cfg.logging.logging_steps)
    _positive("dist_timeout", cfg.runtime.dist_timeout)
    _positive("remote_rm_timeout", cfg.model.remote_rm_timeout)
    _positive("remote_rm_retries", cfg.model.remote_rm_retries)
    _positive("data_timeout", cfg.runtime.data_timeout)
    if cfg.model.reward_timeout is not None:
        _positive("reward_timeout", cfg.model.reward_timeout)
        if cfg.model.reward_timeout >= cfg.runtime.dist_timeout:
            raise ConfigError(
                f"--reward_timeout {cfg.model.reward_timeout:g} must be below --dist_timeout "
                f"{cfg.runtime.dist_timeout:g}: the other ranks wait at most --dist_timeout for the "
                "rewards, so a slower reward function would end the run as a collective timeout instead "
                "of naming itself; raise --dist_timeout too, or lower --reward_timeout"
            )
    _positive("max_skipped_steps", t.max_skipped_steps)
    _check_sequence_parallel(cfg)
    _check_teacher(cfg)
    _check_reward_source(cfg)


def _check_algorithm_extras(cfg: Config) -> None:
    """Clip-higher, GSPO, DAPO dynamic filtering and length penalties (part of check_values)."""
    a, t = cfg.algo, cfg.train
    if a.eps_clip_low_high is not None:
        low, high = a.eps_clip_low_high
        # the PPO family clips the ratio to [1 - LOW, 1 + HIGH]; CISPO caps a weight (verl's example: LOW 10, no lower
        # clip), GMPO bounds log-ratios and DPPO probability moves, where LOW >= 1 has a meaning
        ppo_like = a.policy_loss_type in ("ppo", "gspo", "clip_cov")
        if low <= 0 or high <= 0 or (ppo_like and low >= 1):
            raise ConfigError(
                f"--eps_clip_low_high {low} {high}: needs {'0 < LOW < 1' if ppo_like else 'LOW > 0'} and HIGH > 0 "
                f"(--policy_loss_type {a.policy_loss_type} clips the ratio to [1 - LOW, 1 + HIGH]), e.g. "
                "--eps_clip_low_high 0.2 0.28"
            )
    if a.dynamic_filtering:
        if t.n_samples_per_prompt < 2:
            raise ConfigError(
                f"--dynamic_filtering drops prompt groups by their mean score and needs "
                f"--n_samples_per_prompt >= 2, got {t.n_samples_per_prompt}"
            )
        low, high = a.dynamic_filtering_reward_range
        if low >= high:
            raise ConfigError(
                f"--dynamic_filtering_reward_range needs LOW < HIGH, got {low} {high} (e.g. 0 1 for 0/1 rewards)"
            )
    if a.overlong_buffer_len is not None and not 0 < a.overlong_buffer_len <= cfg.generation.generate_max_len:
        raise ConfigError(
            f"--overlong_buffer_len {a.overlong_buffer_len} must be in (0, --generate_max_len "
            f"{cfg.generation.generate_max_len}]; the penalty ramps over the last N tokens"
        )
    if a.overlong_penalty_factor < 0:
        raise ConfigError(f"--overlong_penalty_factor must be >= 0, got {a.overlong_penalty_factor}")
    _check_policy_loss(a)
    if (flags := correction_flags(a)) and cfg.generation.generation_backend == "hf":
        raise ConfigError(
            f"{flags} corrects the engine/actor log-prob mismatch with the engine's sampled-token log-probs, which "
            "--generation_backend hf does not report; use --generation_backend vllm or native, or drop the flag"
        )
    if a.stop_properly_penalty_coef is not None and a.stop_properly_penalty_coef > 1:
        raise ConfigError(
            f"--stop_properly_penalty_coef {a.stop_properly_penalty_coef}: use a value in [0, 1] "
            "(scales truncated rewards) or a negative one (replaces them)"
        )


def loss_params(a: AlgorithmConfig) -> PolicyLossParams:
    """--policy_loss_type's own parameters."""
    return PolicyLossParams(
        a.sapo_tau_pos, a.sapo_tau_neg, a.clip_cov_ratio, a.clip_cov_bounds, a.kl_cov_ratio, a.kl_cov_coef, a.dro_beta
    )


# OpenRLHF 0.9.4-0.11.0's --vllm_is_correction_type as 0.11.2's (level, mode) with gating "ratio".
_OPENRLHF_TYPES = {"tis": ("token", "clip"), "icepop": ("token", "mask"), "seq-mask-tis": ("seq", "mask")}


def openrlhf_settings(a: AlgorithmConfig) -> tuple[str, str, str, float, float] | None:
    """OpenRLHF's correction as 0.11.2's (level, mode, gating, low, high), from either of its spellings; None: off."""
    low, high = a.is_correction_threshold
    if a.enable_vllm_is_correction:
        level, mode = _OPENRLHF_TYPES[a.vllm_is_correction_type]
        return level, mode, "ratio", low, high
    if a.is_correction_level != "off":
        return a.is_correction_level, a.is_correction_mode, a.is_correction_gating, low, high
    return None


def rollout_correction_of(a: AlgorithmConfig) -> RolloutCorrection:
    """The run's rollout correction, from OpenRLHF's --is_correction_* or verl's --rollout_* (a preset or the
    keys); _check_policy_loss refuses both at once. ValueError for verl settings that do not parse."""
    if (openrlhf := openrlhf_settings(a)) is not None:
        if a.policy_loss_type == "gspo":
            # OpenRLHF's PolicyLoss takes GSPO's sequence ratio against the engine's log-probs instead of weighting.
            return RolloutCorrection(bypass=True)
        return openrlhf_correction(*openrlhf)
    if a.rollout_correction is not None:
        return preset(a.rollout_correction)
    return verl_correction(
        a.rollout_is,
        a.rollout_is_threshold,
        a.rollout_is_batch_normalize,
        a.rollout_rs,
        a.rollout_rs_threshold,
        a.rollout_bypass,
        a.rollout_bypass_loss,
    )


def _check_policy_loss(a: AlgorithmConfig) -> None:
    """--policy_loss_type's parameters and the rollout correction's settings (one of OpenRLHF's or verl's)."""
    if (problem := check_params(a.policy_loss_type, a.dual_clip, loss_params(a))) is not None:
        flags = {"dual_clip": "--dual_clip", "dro_beta": "--dro_beta", "sapo": "--sapo_tau_pos/--sapo_tau_neg"}
        named = next((flag for key, flag in flags.items() if key in problem), "")
        raise ConfigError(f"--policy_loss_type {a.policy_loss_type}: {problem}" + (f"; set {named}" if named else ""))
    if a.enable_vllm_is_correction and a.is_correction_level != "off":
        raise ConfigError(
            f"--enable_vllm_is_correction (--vllm_is_correction_type {a.vllm_is_correction_type}) and "
            f"--is_correction_level {a.is_correction_level} are two releases' spellings of OpenRLHF's correction; "
            "keep one"
        )
    openrlhf = openrlhf_settings(a)
    if openrlhf is not None and (problem := check_openrlhf(*openrlhf)) is not None:
        raise ConfigError(problem)
    verl = [flag for flag in _verl_correction_flags(a) if not flag.startswith("--rollout_correction")]
    if openrlhf is not None and (verl or a.rollout_correction is not None):
        raise ConfigError(
            f"{correction_flags(a)} (OpenRLHF's correction) and {' '.join(_verl_correction_flags(a))} (verl's) both "
            "correct the engine/actor mismatch; keep one"
        )
    if a.rollout_correction is not None and verl:
        raise ConfigError(
            f"--rollout_correction {a.rollout_correction} is a whole verl preset; drop {' '.join(verl)} or the preset"
        )
    try:
        rollout_correction_of(a)
    except ValueError as exc:
        raise ConfigError(f"{' '.join(_verl_correction_flags(a))}: {exc}") from None


def _verl_correction_flags(a: AlgorithmConfig) -> list[str]:
    """verl's rollout-correction flags set to something else than off, as typed."""
    flags = [f"--rollout_correction {a.rollout_correction}"] if a.rollout_correction is not None else []
    if a.rollout_is != "off":
        flags.append(f"--rollout_is {a.rollout_is} --rollout_is_threshold {a.rollout_is_threshold}")
    if a.rollout_rs is not None:
        flags.append(f"--rollout_rs {a.rollout_rs} --rollout_rs_threshold {a.rollout_rs_threshold}")
    if a.rollout_bypass:
        flags.append(f"--rollout_bypass --rollout_bypass_loss {a.rollout_bypass_loss}")
    return flags


def correction_flags(a: AlgorithmConfig) -> str:
    """The flags that turn a rollout correction on, as typed ("" when none does)."""
    if a.enable_vllm_is_correction:
        return f"--enable_vllm_is_correction --vllm_is_correction_type {a.vllm_is_correction_type}"
    if a.is_correction_level != "off":
        return f"--is_correction_level {a.is_correction_level}"
    return " ".join(_verl_correction_flags(a)) if rollout_correction_of(a).active else ""


def _check_dynamic_batch(cfg: Config) -> None:
    """--dynamic_batch's token budgets must hold the longest row a step can have (one row is never split)."""
    t, g = cfg.train, cfg.generation
    longest = g.prompt_max_len + g.generate_max_len
    for name in ("train_max_tokens_per_gpu", "rollout_max_tokens_per_gpu"):
        value = getattr(t, name)
        if value is None:
            continue
        _positive(name, value)
        if t.dynamic_batch and value < longest:
            raise ConfigError(
                f"--{name} {value} is below the longest possible sequence, --prompt_max_len "
                f"{g.prompt_max_len} + --generate_max_len {g.generate_max_len} = {longest} tokens, and "
                f"--dynamic_batch never splits a sequence: raise --{name} to at least {longest}, or "
                "lower the lengths"
            )


REWARD_SOURCES = (
    "--reward_pretrain DIR (a reward model), --remote_rm_url FILE.py or URL (OpenRLHF's reward_func), "
    "--compute_score FILE.py or builtin (verl's compute_score, or its rule scores by data_source), or an "
    "agent (--agent_func_path, --retriever_url)"
)


def _check_partial_rollout(cfg: Config) -> None:
    """--partial_rollout streams single responses between engines and learners on ranks of their own."""
    t = cfg.train
    if not t.partial_rollout:
        return
    _positive("partial_rollout_tokens", t.partial_rollout_tokens)
    _positive("max_staleness", t.max_staleness)
    if not t.async_train:
        raise ConfigError(
            "--partial_rollout needs --async_train (as OpenRLHF's --train.partial_rollout_enable needs "
            "--train.async_enable): unfinished responses carry over while the learners train"
        )
    if cfg.agent.multi_turn:
        raise ConfigError(
            "--partial_rollout does not run agents (--agent_func_path / multi-turn episodes): an episode "
            "is not split at a weight sync; drop --partial_rollout (--async_train alone runs agents)"
        )


def distills_alone(cfg: Config) -> bool:
    """On-policy distillation without a reward: --teacher_pretrain with --distill_task_reward false."""
    return cfg.model.teacher_pretrain is not None and not cfg.algo.distill_task_reward


def scores_nothing(cfg: Config) -> bool:
    """Pure distillation with no reward source on the user's model or data: every sample scores 0 (on the demo's own
    prompts and model the demo rule still scores, logged but not learned from)."""
    m, given = cfg.model, (cfg.model.reward_pretrain, cfg.model.remote_rm_url, cfg.model.compute_score)
    demo = m.pretrain is None and cfg.data.prompt_data is None
    return distills_alone(cfg) and all(v is None for v in given) and not cfg.agent.multi_turn and not demo


def pure_distillation_line(cfg: Config) -> str:
    return f"reward: none; the policy learns from the teacher --teacher_pretrain {cfg.model.teacher_pretrain} alone"


def _check_sequence_parallel(cfg: Config) -> None:
    """--sequence_parallel_size and the per-role sizes: >= 1."""
    r = cfg.resources
    _positive("sequence_parallel_size", cfg.train.sequence_parallel_size)
    for name in ("ref_sequence_parallel_size", "critic_sequence_parallel_size"):
        _positive(name, getattr(r, name), allow_none=True)


def _check_teacher(cfg: Config) -> None:
    """--teacher_pretrain's settings (on-policy distillation)."""
    a = cfg.algo
    if cfg.model.teacher_pretrain is None:
        return
    if a.teacher_kl_coef <= 0:
        raise ConfigError(
            f"--teacher_kl_coef must be > 0 with --teacher_pretrain, got {a.teacher_kl_coef}; to train without the "
            "teacher, drop --teacher_pretrain"
        )
    _positive("teacher_temperature", a.teacher_temperature)
    _positive("teacher_kl_clamp", a.teacher_kl_clamp, allow_none=True)
    if a.teacher_kl_loss and a.teacher_kl_estimator == "k1":
        raise ConfigError(
            "--teacher_kl_loss with --teacher_kl_estimator k1: the gradient of log pi - log pi_teacher does not "
            "depend on the teacher; use k2 or k3 as the loss (verl's GKD default is k3), or the policy-gradient "
            "form (drop --teacher_kl_loss)"
        )


def _check_reward_source(cfg: Config) -> None:
    """Exactly one reward source, never a guessed one: the demo rule scores only the demo's own prompts and
    model, so labelled data or a real model without a source is an error, not a run that learns nothing."""
    m = cfg.model
    given = [
        f"--{name} {value}"
        for name, value in (
            ("reward_pretrain", m.reward_pretrain),
            ("remote_rm_url", m.remote_rm_url),
            ("compute_score", m.compute_score),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ConfigError(f"{' and '.join(given)} are all reward sources; choose one")
    _positive("reward_workers", m.reward_workers, allow_none=True)
    if given or cfg.agent.multi_turn or distills_alone(cfg):
        return
    if cfg.data.prompt_data is not None or m.pretrain is not None:
        what = " and ".join(
            f"--{k} {v}" for k, v in (("pretrain", m.pretrain), ("prompt_data", cfg.data.prompt_data)) if v is not None
        )
        raise ConfigError(
            f"no reward source for {what}: pass {REWARD_SOURCES}. (rlrun does not guess one: its demo "
            f"rule, "
            "--remote_rm_url demo, only fits the demo's built-in prompts.)"
        )


def _check_agent(cfg: Config) -> None:
    ag, m = cfg.agent, cfg.model
    for name in ("max_turns", "max_tokens_per_turn", "max_obs_len"):
        _positive(name, getattr(ag, name), allow_none=True)
    for name in ("retriever_topk", "retriever_timeout", "agent_timeout", "agent_max_concurrency"):
        _positive(name, getattr(ag, name))
    if ag.agent_func_path is not None and ag.retriever_url is not None:
        raise ConfigError(
            f"--agent_func_path {ag.agent_func_path} and --retriever_url {ag.retriever_url} are both "
            f"set; "
            "--retriever_url runs the built-in Search-R1 agent: choose one agent"
        )
    tp = cfg.resources.vllm_tensor_parallel_size
    if cfg.agent.multi_turn and tp > 1 and cfg.generation.generation_backend == "vllm":
        # The engine's ranks share one vLLM engine call by call; episodes end after different numbers of turns on
        # different ranks, so those calls would not line up.
        raise ConfigError(
            f"multi-turn agent episodes (--agent_func_path/--retriever_url) with --generation_backend "
            f"vllm "
            f"--vllm_tensor_parallel_size {tp} are not supported yet; use --vllm_tensor_parallel_size 1 "
            "(more engines instead of wider ones), or --generation_backend hf"
        )
    if not cfg.agent.multi_turn:
        turn_flags = [
            f"--{n}" for n in ("max_turns", "max_tokens_per_turn", "max_obs_len") if getattr(ag, n) is not None
        ]
        turn_flags += [] if ag.state_masking else ["--state_masking false"]
        if turn_flags:
            raise ConfigError(
                f"{', '.join(turn_flags)} shape multi-turn agent episodes; add --agent_func_path FILE.py "
                "or --retriever_url URL, or drop them"
            )
        return
    if m.remote_rm_url is not None or m.reward_pretrain is not None or m.compute_score is not None:
        source = (
            f"--remote_rm_url {m.remote_rm_url}"
            if m.remote_rm_url is not None
            else f"--reward_pretrain {m.reward_pretrain}"
            if m.reward_pretrain is not None
            else f"--compute_score {m.compute_score}"
        )
        raise ConfigError(
            f"{source} with an agent: the agent's step rewards are the reward (as OpenRLHF's "
            "--agent_func_path); score inside the agent, or drop the agent"
        )
    if ag.retriever_url is not None:
        tries = m.remote_rm_retries
        worst = tries * ag.retriever_timeout + RETRIEVER_RETRY_BACKOFF_S * (2 ** (tries - 1) - 1)
        if ag.agent_timeout <= worst:
            raise ConfigError(
                f"--agent_timeout {ag.agent_timeout:g}s is shorter than the retriever's worst case "
                f"({tries} tries x --retriever_timeout {ag.retriever_timeout:g}s + backoff = "
                f"{worst:g}s), "
                "so a retriever that is down would be reported as a slow agent; raise --agent_timeout "
                f"above {worst:g} or lower --retriever_timeout / --remote_rm_retries"
            )
    if not ag.state_masking and (flags := correction_flags(cfg.algo)):
        raise ConfigError(
            "--state_masking false trains on observation tokens, which the engine did not sample and "
            f"has no log-probs for; {flags} needs those: drop one of the two"
        )


def check_batches(cfg: Config, role_sizes: dict[str, int]) -> None:
    """Batch sizes must split evenly over each role's ranks (FSDP ranks must run the same number
    of forward passes, or the job hangs). role_sizes: role name -> number of ranks."""
    t = cfg.train
    rollouts = cfg.train.rollouts_per_step
    for role, size in role_sizes.items():
        if rollouts % size:
            raise ConfigError(
                f"{rollouts} rollouts per step (--rollout_batch_size {t.rollout_batch_size} x "
                f"--n_samples_per_prompt {t.n_samples_per_prompt}) do not split evenly over the {size} {role} ranks; "
                f"make the rollouts a multiple of {size}"
            )
    if rollouts % t.train_batch_size:
        raise ConfigError(
            f"--train_batch_size {t.train_batch_size} must divide the {rollouts} rollouts per step "
            f"(--rollout_batch_size {t.rollout_batch_size} x --n_samples_per_prompt {t.n_samples_per_prompt})"
        )
    for role in ("actor", "critic"):
        ranks = role_sizes.get(role)
        if ranks and t.dynamic_batch and t.train_batch_size % ranks:  # micro-batches by tokens: only the rows split
            raise ConfigError(
                f"--train_batch_size {t.train_batch_size} must be a multiple of the {ranks} {role} ranks "
                "(--dynamic_batch deals each mini-batch's rows evenly over them)"
            )
        if ranks and not t.dynamic_batch and t.train_batch_size % (t.micro_train_batch_size * ranks):
            raise ConfigError(
                f"--train_batch_size {t.train_batch_size} must be a multiple of --micro_train_batch_size "
                f"{t.micro_train_batch_size} x {ranks} {role} ranks = {t.micro_train_batch_size * ranks}"
            )


# ---- supervised trainers -----------------------------------------------------------------------------------------
# Checks of a supervised trainer's settings, on every rank before any process group, model or file is touched.


def check_supervised(cfg: SupervisedConfig, world_size: int, prog: str) -> None:
    t, d = cfg.train, cfg.data
    if d.dataset is None:
        raise ConfigError(
            f"{prog} needs --dataset: a local .jsonl/.json/.parquet/.csv file or saved HF datasets directory"
        )
    for name in ("train_batch_size", "micro_train_batch_size", "max_epochs", "max_len", "max_samples", "logging_steps"):
        section = cfg.logging if name == "logging_steps" else t
        if getattr(section, name) < 1:
            raise ConfigError(f"--{name} must be >= 1, got {getattr(section, name)}")
    check_model_settings(cfg.model)
    check_lora_settings(cfg.model, cfg.checkpoint)
    if t.max_steps is not None and t.max_steps < 1:
        raise ConfigError(f"--max_steps must be >= 1 (or unset), got {t.max_steps}")
    if not t.learning_rate > 0:
        raise ConfigError(f"--learning_rate must be > 0, got {t.learning_rate}")
    _positive("sequence_parallel_size", t.sequence_parallel_size)
    sp = t.sequence_parallel_size
    if world_size % sp:
        raise ConfigError(
            f"--sequence_parallel_size {sp} does not divide the {world_size} ranks (blocks of {sp} consecutive ranks "
            f"share each sample); use a divisor of {world_size}, or launch a multiple of {sp} ranks"
        )
    dp = world_size // sp
    if t.train_batch_size % dp:
        shares = f"{dp} data-parallel shares ({world_size} ranks / --sequence_parallel_size {sp})" if sp > 1 else ""
        raise ConfigError(
            f"--train_batch_size {t.train_batch_size} must be a multiple of the "
            + (shares or f"{world_size} ranks")
            + f" (each takes an equal share of every batch); use e.g. {max(1, t.train_batch_size // dp) * dp}"
        )
    if cfg.checkpoint.max_ckpt_num < 1:
        raise ConfigError(f"--max_ckpt_num must be >= 1, got {cfg.checkpoint.max_ckpt_num}")
    if t.strategy == "deepspeed":
        check_deepspeed_install()
        check_deepspeed_settings(
            t, cfg.model.bf16, saves=cfg.checkpoint.save_steps > 0 or cfg.checkpoint.load_checkpoint
        )
    if isinstance(cfg, DPOConfig):
        loss = cfg.loss
        if not loss.beta > 0:
            raise ConfigError(f"--beta must be > 0, got {loss.beta}")
        if not 0 <= loss.label_smoothing < 0.5:
            raise ConfigError(
                f"--label_smoothing must be in [0, 0.5) (the assumed label-flip probability), got "
                f"{loss.label_smoothing}"
            )
        if loss.nll_loss_coef < 0:
            raise ConfigError(f"--nll_loss_coef must be >= 0, got {loss.nll_loss_coef}")
        if loss.ref_offload and t.strategy == "fsdp" and t.zero_stage < 3:
            # Below ZeRO-3 the frozen reference is kept whole on every GPU (rlrun.strategies.fsdp), so there is no
            # sharded copy for FSDP2's CPU offload to hold: the flag would do nothing.
            raise ConfigError(
                f"--ref_offload needs --zero_stage 3 with --strategy fsdp (at --zero_stage "
                f"{t.zero_stage} "
                "the reference stays whole on each GPU, so nothing would be offloaded); add "
                "--zero_stage 3 "
                "or drop --ref_offload"
            )


# ---- strategies --------------------------------------------------------------------------------------------------
# Strategy rules that need the layout, checked in planning on every rank before any group or model exists.

# The DeepSpeed releases rlrun's adapter was tested with (it relies on mpu, explicit accumulation boundaries,
# safe_get/set_full_*, the ZeRO-1/2 optimizer's partition attributes and ZeRO-3's flat fp32 sub-groups).
# Same range as setup.cfg's extra.
DEEPSPEED_TESTED = ((0, 19, 8), (0, 20, 0))
SHARDED_ROLES = (Role.ACTOR, Role.CRITIC, Role.REF, Role.TEACHER, Role.REWARD)


def reference_is_base(model: PretrainedConfig, loss: DPOLossConfig) -> bool:
    """DPO with --lora_rank and no other --ref_pretrain: the reference is the policy's own base (adapters disabled),
    the initial policy, so no reference copy is built (verl, TRL). A --ref_pretrain naming another model is still
    loaded as a separate frozen reference, as OpenRLHF does (it always builds one)."""
    if model.lora_rank <= 0:
        return False
    ref, pretrain = loss.ref_pretrain, model.pretrain
    return (
        ref is None or ref == pretrain or (pretrain is not None and os.path.realpath(ref) == os.path.realpath(pretrain))
    )


def check_lora(cfg: SupervisedConfig) -> None:
    """What LoRA asks of the supervised trainers beyond check_lora_settings, checked with the command line on
    every rank (after --pretrain is resolved to a local path), before any model is built."""
    if isinstance(cfg, DPOConfig) and reference_is_base(cfg.model, cfg.loss):
        refuse_adapter_as_reference(cfg.model.pretrain, "DPO scores its reference with the policy's adapters off")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 1 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def check_strategy(cfg: Config, layout: Layout) -> None:
    """--strategy deepspeed: installed in the tested range; ZeRO-3 only where every sharded role spans the world."""
    t = cfg.train
    if t.strategy != "deepspeed":
        return
    check_deepspeed_install()
    if t.zero_stage == 3:
        roles = [r for r in SHARDED_ROLES if layout.has(r)]
        narrow = [r for r in roles if len(layout.ranks_of(r)) < layout.world_size]
        if narrow:
            role = narrow[0]
            raise ConfigError(
                f"--strategy deepspeed --zero_stage 3 needs the role ({role.value}: {_ranks(layout.ranks_of(role))}) "
                f"to "
                f"span all {layout.world_size} ranks: DeepSpeed ZeRO-3 calls world-wide barriers at init and "
                f"broadcasts "
                "from global rank 0 in its forward hooks (deepspeed/runtime/zero/stage3.py:914, "
                "partitioned_param_coordinator.py:260), which deadlock when other roles train on other ranks. "
                "Use --strategy fsdp --zero_stage 3 (comparable memory profile, works on role groups)."
            )
    check_deepspeed_settings(t, cfg.model.bf16, saves=cfg.checkpoint.save_steps > 0 or cfg.checkpoint.load_checkpoint)


def check_deepspeed_install() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            "--strategy deepspeed needs DeepSpeed: pip install 'rlrun[deepspeed]' "
            "(deepspeed>=0.19.8,<0.20), "
            "or use --strategy fsdp"
        )
    try:
        found = version("deepspeed")
    except PackageNotFoundError:
        found = "unknown"
    low, high = DEEPSPEED_TESTED
    if not low <= _version_tuple(found) < high:
        raise ConfigError(
            f"--strategy deepspeed is tested with deepspeed>=0.19.8,<0.20, found {found}: "
            "pip install 'rlrun[deepspeed]', or use --strategy fsdp"
        )


def check_deepspeed_settings(train: OptimConfig, bf16: bool, *, saves: bool) -> None:
    """The --strategy deepspeed rules that hold whatever the layout (every model on every rank included)."""
    if train.zero_stage == 0 and train.adam_offload:
        raise ConfigError(
            "--strategy deepspeed --zero_stage 0 --adam_offload: DeepSpeed offloads the optimizer only "
            "at "
            "ZeRO stages 1-3 (at stage 0 DeepSpeedCPUAdam would receive GPU parameters and assert); use "
            "--zero_stage 1 or 2 with --adam_offload, or drop --adam_offload"
        )
    if train.zero_stage == 0 and bf16 and saves:
        raise ConfigError(
            "--strategy deepspeed --zero_stage 0 --bf16 cannot save or load checkpoints yet (its fp32 "
            "master "
            "weights are not reachable by parameter); use --zero_stage 1 or 2, or drop --save_steps/"
            "--load_checkpoint"
        )
