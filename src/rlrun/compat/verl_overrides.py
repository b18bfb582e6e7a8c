"""verl (and Search-R1) Hydra overrides -> rlrun's flags: ``python -m rlrun.ppo data.train_batch_size=512 ...``.

A bare ``key=value`` token (no leading ``--``; Hydra's ``+``/``++`` prefixes allowed) is a verl override.
Each key in ``VERL_KEYS`` means, with verl's semantics (verl 0.9 ``trainer/config/ppo_trainer.yaml`` and
Search-R1's fork of it), one of:

- ``To(field, convert)``: the rlrun field, the value converted (verl's enum names -> rlrun's);
- ``Part(group)``: one input of a rule over several keys (``_kl``, ``_batch``, ...), e.g. verl's mini batch counts
  prompts, so ``train_batch_size = ppo_mini_batch_size * rollout.n``;
- ``Expand(rule)``: one key setting several fields (``trainer.logger``);
- ``Skip(reason)``: accepted and reported as ignored; ``Reject(fix)``: a ConfigError with the fix.

Whole subtrees rlrun has no counterpart for (Megatron, profilers, engine kwargs, FSDP wrap/offload
settings) are skipped by ``SKIPPED_SUBTREES``. Any other key is rejected with a suggestion.

``translate`` replaces each override by ``--field=value`` tokens at its own position (a group's tokens go
where its last key was), so overrides and flags combine with one rule: later on the command line wins.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence, Union, get_args

import yaml

from rlrun.compat.argv import Nargs, split_override, take_values
from rlrun.compat.reasons import NOT_YET, RAY_ONLY
from rlrun.config import FieldInfo, coerce, suggest
from rlrun.errors import ConfigError

Convert = Callable[[Any, str], Any]  # (verl value, key) -> rlrun value; raises ConfigError naming the key
Group = Literal["kl", "batch", "micro", "estimator", "reward_model", "clip"]


@dataclass(frozen=True)
class To:
    field: str
    convert: Convert | None = None


@dataclass(frozen=True)
class Part:
    group: Group


@dataclass(frozen=True)
class Expand:
    """One key setting several rlrun fields: rule(value) -> [(field, value), ...]."""

    rule: Callable[[Any], list[tuple[str, Any]]]


@dataclass(frozen=True)
class Skip:
    reason: str


@dataclass(frozen=True)
class Reject:
    fix: str


Meaning = Union[To, Part, Expand, Skip, Reject]

AGENT = "Search-R1's multi-turn search agent is " + NOT_YET
VLLM_ONLY = "a vLLM/SGLang engine setting rlrun's generation backends do not take"
SHARED = "rlrun uses one value for actor and critic; set it with the actor_rollout_ref.actor key"
SCHEDULE = "rlrun always uses linear warmup + cosine decay to 0.1 x lr"
ONE_MICRO = "rlrun scores rollouts with one micro batch size: actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
DYNAMIC = "dynamic (token-budget) batches are " + NOT_YET
SEQ_PARALLEL = "sequence parallelism is " + NOT_YET
FSDP2 = "rlrun always trains with FSDP2 (see --zero_stage, --adam_offload)"
VLM = "vision-language models are " + NOT_YET
WORLD = "torchrun/srun set the world size; this run has {world_size} rank(s)"  # filled in by translate


# --- value converters ------------------------------------------------------------------------------------------

def _choice(table: Mapping[str, Any], fix: str) -> Convert:
    def convert(value: Any, key: str) -> Any:
        if str(value) not in table:
            raise ConfigError(f"{key}={value}: {fix}{suggest(str(value), table)}")
        return table[str(value)]
    convert.__doc__ = "; ".join(f"{k} -> {v}" for k, v in table.items())  # shown in docs/compat.md
    return convert


def _one_path(value: Any, key: str) -> Any:
    """verl takes a file or a list of files; rlrun reads one file."""
    if isinstance(value, list):
        if len(value) != 1:
            raise ConfigError(f"{key}={value}: rlrun reads one prompt file; merge the files or pass one")
        return value[0]
    return value


def _int(value: Any, key: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be an integer, got {value!r}") from None


def _checked_bool(value: Any, key: str) -> bool:
    text = str(value).lower()
    if text not in ("true", "false", "1", "0"):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return text in ("true", "1")


ESTIMATORS = {"gae": "gae", "grpo": "group_norm", "reinforce_plus_plus": "reinforce",
              "reinforce_plus_plus_baseline": "reinforce_baseline", "rloo": "rloo"}
KL_TYPES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
_kl_type = _choice(KL_TYPES, "rlrun's KL estimators are kl/k1, mse/k2 and low_var_kl/k3")
_backend = _choice({"vllm": "vllm", "hf": "hf"}, "rlrun generates with vllm or hf")
_resume = _choice({"auto": True, "disable": False},
                  "rlrun resumes from the newest complete checkpoint in trainer.default_local_dir: use "
                  "trainer.resume_mode=auto (or disable)")
_overflow = _choice({"True": "drop", "False": "truncate", "true": "drop", "false": "truncate"},
                    "use true (drop overlong prompts) or false (keep their last tokens)")


def _logger(value: Any) -> list[tuple[str, Any]]:
    """trainer.logger=['console','wandb'] (a list or one name): wandb on (key from WANDB_API_KEY) or off."""
    names = value if isinstance(value, list) else [value]
    unknown = [n for n in names if n not in ("console", "wandb", "tensorboard")]
    if unknown:
        raise ConfigError(f"trainer.logger: rlrun logs to console, wandb and tensorboard, not {', '.join(map(str, unknown))}")
    out: list[tuple[str, Any]] = [("use_wandb", "" if "wandb" in names else None)]
    if "tensorboard" in names:  # verl's default directory, TENSORBOARD_DIR overriding it
        out.append(("use_tensorboard", os.environ.get("TENSORBOARD_DIR", "tensorboard_log")))
    return out


# --- the key table ---------------------------------------------------------------------------------------------

A, R, C = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "critic."

VERL_KEYS: dict[str, Meaning] = {
    # data
    "data.train_files": To("prompt_data", _one_path),
    "data.val_files": To("eval_dataset", _one_path),
    "data.prompt_key": To("input_key"),
    "data.train_batch_size": To("rollout_batch_size"),  # prompts per step
    "data.val_batch_size": Skip("rlrun evaluates the whole eval set each time"),
    "data.max_prompt_length": To("prompt_max_len"),
    "data.max_response_length": To("generate_max_len"),
    "data.filter_overlong_prompts": To("prompt_overflow", _overflow),
    "data.truncation": Skip("rlrun drops overlong prompts (data.filter_overlong_prompts=True) or keeps their last tokens"),
    "data.shuffle": Skip("rlrun always shuffles prompts, seeded by --seed"),
    "data.shuffle_train_dataloader": Skip("rlrun always shuffles prompts, seeded by --seed"),
    "data.seed": Skip("rlrun seeds the prompt order with --seed"),
    "data.train_data_num": To("max_samples"),  # Search-R1: cap on training prompts (null: all)
    "data.val_data_num": Skip(NOT_YET),
    "data.max_start_length": Skip(AGENT),
    "data.max_obs_length": Skip(AGENT),
    "data.return_raw_chat": Skip("rlrun keeps the raw prompt text for the reward anyway"),
    "data.return_raw_input_ids": Skip("rlrun keeps the raw prompt text for the reward anyway"),
    "data.tokenizer": Skip("rlrun uses the policy's tokenizer"),
    "data.trust_remote_code": Skip(NOT_YET),
    "data.image_key": Skip(VLM),
    "data.reward_fn_key": Skip("verl's per-data-source reward functions are not used; rlrun takes --remote_rm_url"),
    "data.dataloader_num_workers": Skip("rlrun reads the prompt file once, in each process"),
    "data.filter_overlong_prompts_workers": Skip("rlrun reads the prompt file once, in each process"),
    # models
    "actor_rollout_ref.model.path": To("pretrain"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": To("gradient_checkpointing"),
    "actor_rollout_ref.model.use_remove_padding": To("packing_samples"),
    "actor_rollout_ref.model.trust_remote_code": Skip(NOT_YET),
    "actor_rollout_ref.model.use_fused_kernels": Skip(NOT_YET),
    "actor_rollout_ref.model.use_shm": Skip(NOT_YET),
    "actor_rollout_ref.model.external_lib": Skip(NOT_YET),
    "actor_rollout_ref.model.lora_rank": To("lora_rank"),
    "actor_rollout_ref.model.lora_alpha": To("lora_alpha"),
    "actor_rollout_ref.model.target_modules": Skip(NOT_YET),
    "actor_rollout_ref.hybrid_engine": Skip("rlrun places engines by --vllm_num_engines "
                                            "(unset: on the actor's ranks, like verl's hybrid engine)"),
    "actor_rollout_ref.nccl_timeout": To("dist_timeout"),
    "critic.model.path": To("critic_pretrain"),
    "critic.model.enable_gradient_checkpointing": Skip(SHARED.replace("actor_rollout_ref.actor", "actor_rollout_ref.model")),
    "critic.model.use_remove_padding": To("packing_samples"),
    "critic.model.trust_remote_code": Skip(NOT_YET),
    "critic.model.tokenizer_path": Skip("rlrun uses the policy's tokenizer"),
    "reward_model.enable": Part("reward_model"),
    "reward_model.model.path": Part("reward_model"),
    "reward_model.micro_batch_size": Skip(ONE_MICRO),
    "reward_model.micro_batch_size_per_gpu": Skip(ONE_MICRO),
    "reward_model.reward_manager": Skip("verl's reward managers are not used; rlrun takes --remote_rm_url"),
    "reward_model.use_reward_loop": Skip("verl's reward managers are not used; rlrun takes --remote_rm_url"),
    "reward_model.num_workers": Skip("verl's reward managers are not used; rlrun takes --remote_rm_url"),
    "reward_model.structure_format_score": Skip(AGENT),
    "reward_model.final_format_score": Skip(AGENT),
    "reward_model.retrieval_score": Skip(AGENT),
    "custom_reward_function.path": Reject("verl's compute_score(data_source, solution_str, ground_truth, extra_info) "
                                          "is not rlrun's reward: write reward_func(queries, prompts, labels) "
                                          "and pass --remote_rm_url FILE.py"),
    "custom_reward_function.name": Reject("write reward_func(queries, prompts, labels) and pass --remote_rm_url FILE.py"),
    # actor optimisation
    A + "optim.lr": To("actor_learning_rate"),
    A + "optim.lr_warmup_steps_ratio": To("lr_warmup_ratio"),
    A + "optim.lr_warmup_steps": Skip("rlrun sets warmup as a ratio: actor_rollout_ref.actor.optim.lr_warmup_steps_ratio"),
    A + "optim.weight_decay": To("l2"),
    A + "optim.betas": To("adam_betas"),
    A + "optim.clip_grad": To("max_norm"),
    A + "optim.warmup_style": Skip(SCHEDULE),
    A + "optim.lr_scheduler_type": Skip(SCHEDULE),
    A + "optim.lr_decay_style": Skip(SCHEDULE),
    A + "optim.min_lr_ratio": Skip(SCHEDULE),
    A + "optim.num_cycles": Skip(SCHEDULE),
    A + "optim.total_training_steps": Skip("verl fills it in at run time"),
    A + "grad_clip": To("max_norm"),
    A + "ppo_epochs": To("max_epochs"),
    A + "ppo_mini_batch_size": Part("batch"),
    A + "ppo_micro_batch_size": Part("micro"),
    A + "ppo_micro_batch_size_per_gpu": To("micro_train_batch_size"),
    A + "clip_ratio": Part("clip"),
    A + "clip_ratio_low": Part("clip"),
    A + "clip_ratio_high": Part("clip"),
    A + "clip_ratio_c": To("dual_clip"),
    A + "entropy_coeff": To("entropy_loss_coef"),
    A + "loss_agg_mode": To("loss_agg_mode"),
    A + "use_kl_loss": Part("kl"),
    A + "kl_loss_coef": Part("kl"),
    A + "kl_loss_type": Part("kl"),
    A + "use_dynamic_bsz": Skip(DYNAMIC),
    A + "ppo_max_token_len_per_gpu": Skip(DYNAMIC),
    A + "ulysses_sequence_parallel_size": Skip(SEQ_PARALLEL),
    A + "use_torch_compile": Skip(NOT_YET),
    A + "strategy": Skip(FSDP2),
    A + "shuffle": Skip("rlrun always shuffles each rollout batch, seeded by --seed"),
    A + "state_masking": Skip(AGENT),
    A + "freeze_vision_tower": Skip(VLM),
    # reference model
    "actor_rollout_ref.ref.log_prob_micro_batch_size": Skip(ONE_MICRO),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": Skip(ONE_MICRO),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": Skip(DYNAMIC),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": Skip(DYNAMIC),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": Skip(SEQ_PARALLEL),
    "actor_rollout_ref.ref.use_torch_compile": Skip(NOT_YET),
    "actor_rollout_ref.ref.strategy": Skip(FSDP2),
    # rollout
    R + "name": To("generation_backend", _backend),
    R + "n": Part("batch"),
    R + "n_agent": Part("batch"),  # Search-R1: the batch is repeated n_agent times before generation
    R + "temperature": To("temperature"),
    R + "top_p": To("top_p"),
    R + "top_k": Skip("rlrun samples without top-k"),
    R + "do_sample": Skip("rlrun always samples"),
    R + "tensor_model_parallel_size": To("vllm_tensor_parallel_size"),
    R + "gpu_memory_utilization": To("vllm_gpu_memory_utilization"),
    R + "enforce_eager": To("enforce_eager"),
    R + "free_cache_engine": Skip(VLLM_ONLY),
    R + "log_prob_micro_batch_size": Part("micro"),
    R + "log_prob_micro_batch_size_per_gpu": To("micro_rollout_batch_size"),
    R + "log_prob_use_dynamic_bsz": Skip(DYNAMIC),
    R + "log_prob_max_token_len_per_gpu": Skip(DYNAMIC),
    R + "prompt_length": Skip("follows data.max_prompt_length"),
    R + "response_length": Skip("follows data.max_response_length"),
    R + "val_kwargs.temperature": To("eval_temperature"),
    R + "val_kwargs.n": To("eval_n_samples_per_prompt"),
    R + "val_kwargs.top_p": Skip(NOT_YET),
    R + "val_kwargs.top_k": Skip(NOT_YET),
    R + "val_kwargs.do_sample": Skip(NOT_YET),
    **{R + k: Skip(VLLM_ONLY) for k in (
        "mode", "dtype", "load_format", "enable_chunked_prefill", "max_num_batched_tokens", "max_num_seqs",
        "max_model_len", "ignore_eos", "calculate_log_probs", "multi_stage_wake_up", "layered_summon",
        "data_parallel_size", "expert_parallel_size", "disable_log_stats", "enable_prefix_caching")},
    # critic
    C + "optim.lr": To("critic_learning_rate"),
    C + "optim.lr_warmup_steps_ratio": Skip(SHARED),
    C + "optim.weight_decay": Skip(SHARED),
    C + "optim.warmup_style": Skip(SCHEDULE),
    C + "optim.min_lr_ratio": Skip(SCHEDULE),
    C + "optim.clip_grad": Skip(SHARED),
    C + "grad_clip": Skip(SHARED),
    C + "ppo_epochs": Skip(SHARED),
    C + "ppo_mini_batch_size": Skip(SHARED),
    C + "ppo_micro_batch_size": Skip(SHARED),
    C + "ppo_micro_batch_size_per_gpu": Skip(SHARED),
    C + "forward_micro_batch_size": Skip(ONE_MICRO),
    C + "forward_micro_batch_size_per_gpu": Skip(ONE_MICRO),
    C + "cliprange_value": To("value_clip"),
    C + "use_dynamic_bsz": Skip(DYNAMIC),
    C + "ppo_max_token_len_per_gpu": Skip(DYNAMIC),
    C + "forward_max_token_len_per_gpu": Skip(DYNAMIC),
    C + "ulysses_sequence_parallel_size": Skip(SEQ_PARALLEL),
    C + "strategy": Skip(FSDP2),
    C + "shuffle": Skip("rlrun always shuffles each rollout batch, seeded by --seed"),
    # algorithm
    "algorithm.adv_estimator": Part("estimator"),
    "algorithm.norm_adv_by_std_in_grpo": Part("estimator"),
    "algorithm.gamma": To("gamma"),
    "algorithm.lam": To("lambd"),
    "algorithm.use_kl_in_reward": Part("kl"),
    "algorithm.kl_penalty": Part("kl"),
    "algorithm.kl_ctrl.type": Part("kl"),
    "algorithm.kl_ctrl.kl_coef": Part("kl"),
    "algorithm.kl_ctrl.target_kl": Part("kl"),
    "algorithm.kl_ctrl.horizon": Part("kl"),
    "algorithm.no_think_rl": Skip(AGENT),
    "algorithm.use_pf_ppo": Skip(NOT_YET),
    "algorithm.state_masking.start_state_marker": Skip(AGENT),
    "algorithm.state_masking.end_state_marker": Skip(AGENT),
    # trainer
    "trainer.total_epochs": To("num_episodes"),
    "trainer.total_training_steps": To("max_steps"),
    "trainer.save_freq": To("save_steps"),
    "trainer.test_freq": To("eval_steps"),
    "trainer.default_local_dir": To("ckpt_path"),
    "trainer.resume_mode": To("load_checkpoint", _resume),
    "trainer.resume_from_path": Skip("rlrun resumes from the newest complete checkpoint in trainer.default_local_dir"),
    "trainer.max_actor_ckpt_to_keep": To("max_ckpt_num"),
    "trainer.max_critic_ckpt_to_keep": Skip("one rlrun checkpoint holds actor and critic: trainer.max_actor_ckpt_to_keep"),
    "trainer.logger": Expand(_logger),
    "trainer.project_name": To("wandb_project"),
    "trainer.experiment_name": To("wandb_run_name"),
    "trainer.n_gpus_per_node": Skip(WORLD),
    "trainer.nnodes": Skip(WORLD),
    "trainer.val_before_train": To("eval_before_train"),
    "trainer.val_only": Skip(NOT_YET),
    "trainer.critic_warmup": To("freezing_actor_steps"),  # steps that train only the critic
    "trainer.default_hdfs_dir": Skip("HDFS upload is " + NOT_YET),
    "trainer.use_legacy_worker_impl": Skip("a verl worker implementation switch"),
    "trainer.log_val_generations": Skip(NOT_YET),
    "trainer.balance_batch": Skip("rlrun splits rollouts evenly by count"),
    "trainer.device": Skip("rlrun picks the device with --device"),
    "trainer.del_local_ckpt_after_load": Skip(NOT_YET),
    "trainer.ray_wait_register_center_timeout": Skip(RAY_ONLY),
    # Search-R1 top-level keys
    "max_turns": Skip(AGENT),
    "do_search": Skip(AGENT),
    "retriever.url": Skip(AGENT),
    "retriever.topk": Skip(AGENT),
}

# Whole subtrees: a key with one of these path segments is skipped with the reason.
SKIPPED_SUBTREES: dict[str, str] = {
    "megatron": "the Megatron backend: " + FSDP2,
    "fsdp_config": "verl's FSDP wrap/offload settings: " + FSDP2,
    "profiler": "verl's profiler is not part of rlrun",
    "global_profiler": "verl's profiler is not part of rlrun",
    "engine_kwargs": VLLM_ONLY,
    "multi_turn": "verl's multi-turn rollout is " + NOT_YET,
    "checkpoint_engine": "rlrun syncs weights with bucketed broadcasts (--weight_sync_bucket_mb)",
    "override_config": NOT_YET,
    "lora": NOT_YET,
    "ray_kwargs": RAY_ONLY,
    "ray_init": RAY_ONLY,
    "sandbox_fusion": "verl's reward managers are not used; rlrun takes --remote_rm_url",
    "reward_kwargs": "verl's reward managers are not used; rlrun takes --remote_rm_url",
    "rollout_correction": NOT_YET,
    "pf_ppo": NOT_YET,
    "filter_groups": NOT_YET,
}


def meaning_of(key: str) -> Meaning | None:
    if key in VERL_KEYS:
        return VERL_KEYS[key]
    for segment in key.split("."):
        if segment in SKIPPED_SUBTREES:
            return Skip(SKIPPED_SUBTREES[segment])
    return None


# --- rules over several keys -------------------------------------------------------------------------------------

Assignment = tuple[str, Any]  # (rlrun field, value)


def _kl(v: Mapping[str, Any]) -> list[Assignment]:
    """verl: KL as a loss (actor.use_kl_loss) and/or in the reward (algorithm.use_kl_in_reward, default false).

    Search-R1's older verl has no use_kl_in_reward and always puts kl_ctrl.kl_coef in the reward unless
    use_kl_loss; so kl_coef given without use_kl_in_reward turns the reward penalty on.
    """
    use_loss = _checked_bool(v.get(A + "use_kl_loss", False), A + "use_kl_loss")
    in_reward_set = "algorithm.use_kl_in_reward" in v
    in_reward = _checked_bool(v["algorithm.use_kl_in_reward"], "algorithm.use_kl_in_reward") if in_reward_set else (
        "algorithm.kl_ctrl.kl_coef" in v and not use_loss)
    if use_loss and in_reward:
        raise ConfigError("actor_rollout_ref.actor.use_kl_loss=True and algorithm.use_kl_in_reward=True: rlrun puts "
                          "the KL either in the loss or in the reward; set one of them to False")
    out: list[Assignment] = []
    if A + "use_kl_loss" in v:
        out.append(("use_kl_loss", use_loss))
    if use_loss:
        out.append(("init_kl_coef", v.get(A + "kl_loss_coef", 0.001)))
        out.append(("kl_estimator", _kl_type(v.get(A + "kl_loss_type", "low_var_kl"), A + "kl_loss_type")))
    elif in_reward:
        out.append(("init_kl_coef", v.get("algorithm.kl_ctrl.kl_coef", 0.001)))
        out.append(("kl_estimator", _kl_type(v.get("algorithm.kl_penalty", "kl"), "algorithm.kl_penalty")))
        kind = v.get("algorithm.kl_ctrl.type", "fixed")
        if kind not in ("fixed", "adaptive"):
            raise ConfigError(f"algorithm.kl_ctrl.type={kind}: use fixed or adaptive")
        if "algorithm.kl_ctrl.type" in v:
            out.append(("kl_target", v.get("algorithm.kl_ctrl.target_kl", 0.1) if kind == "adaptive" else None))
        if kind == "adaptive":
            out.append(("kl_horizon", v.get("algorithm.kl_ctrl.horizon", 10000)))
    elif in_reward_set:  # verl with both off: no KL at all
        out.append(("init_kl_coef", 0.0))
    return out


def _batch(v: Mapping[str, Any]) -> list[Assignment]:
    """Samples per prompt = rollout.n (x Search-R1's n_agent); verl's mini batch counts prompts: x rollout.n."""
    n = _int(v.get(R + "n", 1), R + "n")
    out: list[Assignment] = []
    if R + "n" in v or R + "n_agent" in v:
        out.append(("n_samples_per_prompt", n * _int(v.get(R + "n_agent", 1), R + "n_agent")))
    if A + "ppo_mini_batch_size" in v:
        out.append(("train_batch_size", _int(v[A + "ppo_mini_batch_size"], A + "ppo_mini_batch_size") * n))
    return out


def _micro(v: Mapping[str, Any], world_size: int) -> list[Assignment]:
    """verl's deprecated global micro batch sizes are split over all ranks (verl puts every role on every GPU)."""
    out: list[Assignment] = []
    for key, target in ((A + "ppo_micro_batch_size", "micro_train_batch_size"),
                        (R + "log_prob_micro_batch_size", "micro_rollout_batch_size")):
        if key in v:
            total = _int(v[key], key)
            if total < world_size or total % world_size:
                raise ConfigError(f"{key}={total} is a global micro batch size; it must be a multiple of the "
                                  f"{world_size} launched ranks (or use {key}_per_gpu)")
            out.append((target, total // world_size))
    return out


def _estimator(v: Mapping[str, Any]) -> list[Assignment]:
    """gae; grpo -> group_norm (dr_grpo with norm_adv_by_std_in_grpo=False); reinforce_plus_plus(_baseline); rloo."""
    if "algorithm.adv_estimator" not in v:
        return []  # norm_adv_by_std_in_grpo alone changes nothing outside GRPO
    name = str(v["algorithm.adv_estimator"])
    norm = _checked_bool(v.get("algorithm.norm_adv_by_std_in_grpo", True), "algorithm.norm_adv_by_std_in_grpo")
    if name not in ESTIMATORS:
        raise ConfigError(f"algorithm.adv_estimator={name}: rlrun implements {', '.join(ESTIMATORS)}"
                          f"{suggest(name, ESTIMATORS)}")
    if name == "grpo" and not norm:  # Dr. GRPO: group mean subtracted, no division by the std
        return [("advantage_estimator", "dr_grpo")]
    return [("advantage_estimator", ESTIMATORS[name])]


def _reward_model(v: Mapping[str, Any]) -> list[Assignment]:
    """verl loads reward_model.model.path only when reward_model.enable is true."""
    if _checked_bool(v.get("reward_model.enable", False), "reward_model.enable"):
        if "reward_model.model.path" not in v:
            raise ConfigError("reward_model.enable=True needs reward_model.model.path")
        return [("reward_pretrain", v["reward_model.model.path"])]
    return []


def _clip(v: Mapping[str, Any]) -> list[Assignment]:
    """clip_ratio_low/high default to clip_ratio (verl); rlrun: --eps_clip and --eps_clip_low_high."""
    clip = v.get(A + "clip_ratio", 0.2)
    out: list[Assignment] = [("eps_clip", clip)] if A + "clip_ratio" in v else []
    if A + "clip_ratio_low" in v or A + "clip_ratio_high" in v:
        low, high = v.get(A + "clip_ratio_low", clip), v.get(A + "clip_ratio_high", clip)
        out.append(("eps_clip_low_high", (clip if low is None else low, clip if high is None else high)))
    return out


# --- translation ---------------------------------------------------------------------------------------------------

def parse_value(raw: str) -> Any:
    """A Hydra override value: YAML scalars and flow lists (null, true, 1e-6, ['console','wandb']), else text."""
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return raw
    # YAML 1.1 reads 1e-6 as text: coerce() turns it into the field's number type later.
    return value if isinstance(value, (str, int, float, bool, list, type(None))) else raw


def launched_world_size() -> int:
    """Ranks the launcher started (torchrun: WORLD_SIZE, srun: SLURM_NTASKS); 1 for a plain `python -m`."""
    return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)


@dataclass
class Translated:
    argv: list[str]  # rlrun flags only
    ignored: list[str] = field(default_factory=list)  # one report line per ignored key


def _tokens(assignments: list[Assignment], source: str, fields: Mapping[str, FieldInfo],
            classic_ignored: Mapping[str, tuple[int | str, str]], ignored: list[str]) -> list[str]:
    """rlrun flag tokens for the assignments; a field rlrun lacks is reported, never an error."""
    out: list[str] = []
    for name, value in assignments:
        if name not in fields:
            reason = classic_ignored[name][1] if name in classic_ignored else NOT_YET
            ignored.append(f"{source}: ignored ({reason})")
            continue
        checked = coerce(fields[name], value, source)  # errors name the verl key
        if isinstance(checked, tuple):
            out += [f"--{name}", *map(str, checked)]
        else:
            text = "none" if checked is None else str(checked).lower() if isinstance(checked, bool) else str(checked)
            out.append(f"--{name}={text}")
    return out


def translate(argv: Sequence[str], arity: Callable[[str], Nargs], fields: Mapping[str, FieldInfo],
              classic_ignored: Mapping[str, tuple[int | str, str]], world_size: int) -> Translated:
    """Replace verl overrides in argv (classic rlrun flags otherwise) by rlrun flags, in place.

    `arity(flag name)` says how many values a flag takes, so that a flag's value is never read as an override.
    """
    out: list[str | None] = []
    result = Translated([])
    groups: dict[Group, dict[str, Any]] = {}
    group_at: dict[Group, int] = {}  # index in `out` of the placeholder for a group's tokens
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token.startswith("--"):
            out.append(token)
            name, eq, _ = token[2:].partition("=")
            if not eq:
                values = take_values(argv, i, arity(name), token)
                out += values
                i += len(values)
            continue
        parts = split_override(token)
        if parts is None:
            out.append(token)  # a stray positional: argparse reports it
            continue
        prefix, key, raw = parts
        if prefix == "~":
            raise ConfigError(f"{token}: rlrun has no key deletion; leave the key out")
        meaning = meaning_of(key)
        if meaning is None:
            raise ConfigError(f"unknown verl key '{key}'{suggest(key, VERL_KEYS)}")
        value = parse_value(raw)
        if isinstance(meaning, Skip):
            result.ignored.append(f"{key}: ignored ({meaning.reason.format(world_size=world_size)})")
        elif isinstance(meaning, Reject):
            if value not in (None, ""):  # null is verl's default: nothing asked for
                raise ConfigError(f"{key}: {meaning.fix}")
        elif isinstance(meaning, Part):
            groups.setdefault(meaning.group, {})[key] = value
            group_at[meaning.group] = len(out)  # the group's tokens go where its last key is
            out.append(None)
        elif isinstance(meaning, Expand):
            out += _tokens(meaning.rule(value), key, fields, classic_ignored, result.ignored)
        elif value is None and meaning.field in fields and type(None) not in get_args(fields[meaning.field].type):
            continue  # verl's null where rlrun needs a value: keep rlrun's default (data.train_data_num=null)
        else:
            converted = meaning.convert(value, key) if meaning.convert else value
            out += _tokens([(meaning.field, converted)], key, fields, classic_ignored, result.ignored)
    rules: dict[Group, Callable[[Mapping[str, Any]], list[Assignment]]] = {
        "kl": _kl, "batch": _batch, "estimator": _estimator, "reward_model": _reward_model, "clip": _clip,
        "micro": lambda v: _micro(v, world_size)}
    expanded: list[str] = []
    at = {index: group for group, index in group_at.items()}
    for index, token in enumerate(out):
        if token is not None:
            expanded.append(token)
        elif index in at:
            group = at[index]
            source = ", ".join(groups[group])
            expanded += _tokens(rules[group](groups[group]), source, fields, classic_ignored, result.ignored)
    result.argv = expanded
    return result

