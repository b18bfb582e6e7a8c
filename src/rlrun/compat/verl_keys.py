"""verl (and Search-R1) override keys and what each means in rlrun (a data table; verl_overrides applies it).

Each key in ``VERL_KEYS`` means, with verl's semantics (verl 0.9 ``trainer/config/ppo_trainer.yaml`` and
Search-R1's fork of it), one of:

- ``To(field, convert)``: the rlrun field, the value converted (verl's enum names -> rlrun's);
- ``GroupInput(group)``: one input of a rule over several keys (verl_overrides' ``_kl``, ``_batch``, ...), e.g. verl's
  mini batch counts prompts, so ``train_batch_size = ppo_mini_batch_size * rollout.n``;
- ``Expand(rule)``: one key setting several fields (``trainer.logger``);
- ``Skip(reason)``: accepted and reported as ignored; ``Reject(fix)``: a ConfigError with the fix.

Whole subtrees rlrun has no counterpart for (Megatron, profilers, engine kwargs, FSDP wrap/offload
settings) are skipped by ``SKIPPED_SUBTREES``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from rlrun.compat.argv import NOT_YET, RAY_ONLY
from rlrun.config.fields import suggest
from rlrun.runtime.errors import ConfigError

Convert = Callable[[Any, str], Any]  # (verl value, key) -> rlrun value; raises ConfigError naming the key
Group = Literal["kl", "batch", "micro", "estimator", "data", "clip", "turns", "lora", "cov", "distill", "sp"]


@dataclass(frozen=True)
class To:
    field: str
    convert: Convert | None = None


@dataclass(frozen=True)
class GroupInput:
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


Meaning = To | GroupInput | Expand | Skip | Reject

FORMAT_REWARD = (
    "Search-R1's format-reward variant (qa_em_format) is " + NOT_YET + "; rlrun's Search-R1 agent scores exact match"
)
BY_PROVENANCE = "rlrun masks observation tokens by where they came from (the agent), not by text markers"
VLLM_ONLY = "a vLLM/SGLang engine setting rlrun's generation backends do not take"
SHARED = "rlrun uses one value for actor and critic; set it with the actor_rollout_ref.actor key"
SCHEDULE = "rlrun always uses linear warmup + cosine decay to 0.1 x lr"
ONE_MICRO = (
    "rlrun scores rollouts with one micro batch size: actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"
)
ONE_SWITCH = (
    "rlrun turns token-budget micro-batches on for scoring and training together: "
    "actor_rollout_ref.actor.use_dynamic_bsz (--dynamic_batch)"
)
ONE_SCORING_BUDGET = (
    "rlrun scores rollouts with one token budget: "
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu (--rollout_max_tokens_per_gpu)"
)
FSDP2 = (
    "rlrun trains with FSDP2, the default, or DeepSpeed ZeRO-0/1/2 (ZeRO-3 with every model on every rank) with "
    "--strategy deepspeed; see --zero_stage, --adam_offload"
)
WORLD = "torchrun/srun set the world size; this run has {world_size} rank(s)"  # filled in by translate
SHM = "verl copies the model to /dev/shm before loading it, a loading-speed setting; rlrun reads it where it is"
ADAPTER_PATH = (
    "rlrun starts from a saved LoRA adapter when the model path is the adapter directory: pass it as "
    "actor_rollout_ref.model.path (or --pretrain); its adapter_config.json names the base model"
)


# --- value converters ------------------------------------------------------------------------------------------


def _choice(table: Mapping[str, Any], fix: str) -> Convert:
    def convert(value: Any, key: str) -> Any:
        if str(value) not in table:
            raise ConfigError(f"{key}={value}: {fix}{suggest(str(value), table)}")
        return table[str(value)]

    convert.__doc__ = "; ".join(f"{k} -> {v}" for k, v in table.items())  # shown in docs/compat.md
    return convert


def source_list(value: Any, key: str) -> Any:
    """A file or a list of files (verl concatenates them): comma-separated sources, which rlrun concatenates too."""
    if isinstance(value, list):
        if not value or any("," in str(v) for v in value):
            raise ConfigError(f"{key}={value}: give one or more files, none with a comma in its path")
        return ",".join(str(v) for v in value)
    return value


def as_int(value: Any, key: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be an integer, got {value!r}") from None


def as_bool(value: Any, key: str) -> bool:
    """true/false (or 1/0)"""
    text = str(value).lower()
    if text not in ("true", "false", "1", "0"):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return text in ("true", "1")


ESTIMATORS = {
    "gae": "gae",
    "grpo": "group_norm",
    "reinforce_plus_plus": "reinforce",
    "reinforce_plus_plus_baseline": "reinforce_baseline",
    "rloo": "rloo",
}
KL_TYPES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
kl_type = _choice(KL_TYPES, "rlrun's KL estimators are kl/k1, mse/k2 and low_var_kl/k3")
_backend = _choice({"vllm": "vllm", "hf": "hf"}, "rlrun generates with vllm or hf")
_resume = _choice(
    {"auto": True, "disable": False},
    "rlrun resumes from the newest complete checkpoint in trainer.default_local_dir: use "
    "trainer.resume_mode=auto (or disable)",
)
_overflow = _choice(
    {"True": "drop", "False": "truncate", "true": "drop", "false": "truncate"},
    "use true (drop overlong prompts) or false (keep their last tokens)",
)


def _logger(value: Any) -> list[tuple[str, Any]]:
    """trainer.logger=['console','wandb'] (a list or one name): wandb on (key from WANDB_API_KEY) or off."""
    names = value if isinstance(value, list) else [value]
    unknown = [n for n in names if n not in ("console", "wandb", "tensorboard")]
    if unknown:
        raise ConfigError(
            f"trainer.logger: rlrun logs to console, wandb and tensorboard, not {', '.join(map(str, unknown))}"
        )
    out: list[tuple[str, Any]] = [("use_wandb", "" if "wandb" in names else None)]
    if "tensorboard" in names:  # verl's default directory, TENSORBOARD_DIR overriding it
        out.append(("use_tensorboard", os.environ.get("TENSORBOARD_DIR", "tensorboard_log")))
    return out


def _fully_async(value: Any) -> list[tuple[str, Any]]:
    """async_training.partial_rollout: verl's fully-async trainer is asynchronous whatever the value (--async_train);
    true continues unfinished responses across weight syncs (--partial_rollout)."""
    return [("async_train", True), ("partial_rollout", as_bool(value, "async_training.partial_rollout"))]


FULLY_ASYNC = "verl's fully-async trainer setting; rlrun's --partial_rollout "

# verl's registered policy losses (core_algos.py @register_policy_loss) -> --policy_loss_type
LOSS_MODES = {
    "vanilla": "ppo",
    "gspo": "gspo_token",  # verl's form: each token's own advantage and gradient (rlrun's gspo is OpenRLHF's)
    **{name: name for name in ("sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo", "dppo_tv")},
    **{name: name for name in ("dppo_kl", "dro")},
}
_loss_mode = _choice(
    LOSS_MODES,
    "rlrun runs verl's vanilla, gspo, sapo, gpg, clip_cov, kl_cov, geo_mean, cispo, dppo_tv, dppo_kl and dro "
    "(bypass_mode is what verl sets for algorithm.rollout_correction.bypass_mode=true: set that instead)",
)


# verl's actor.router_replay.mode -> --router_replay
_router_replay = _choice({"disabled": "off", "R2": "R2", "R3": "R3"}, "verl's modes are disabled, R2 and R3")


def as_text(value: Any, key: str) -> str:
    """a number or text, kept as text (verl's rollout_is_threshold: 2.0 or "0.5_5.0")"""
    return str(value)


def option_list(value: Any, key: str) -> str:
    """one option, a comma list or a list of them: a comma list"""
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


RC = "algorithm.rollout_correction."
D, DL, TEACHER = "distillation.", "distillation.distillation_loss.", "distillation.teacher_models.teacher_model."
SERVER_TEACHER = "rlrun runs the teacher as a frozen model on its own ranks or the actor's, not an inference server"
ACTOR_RC = "verl writes the actor's copy from algorithm.rollout_correction.*, which rlrun reads"
# --- the key table ---------------------------------------------------------------------------------------------

A, R, C = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "critic."
REF = "actor_rollout_ref.ref."

VERL_KEYS: dict[str, Meaning] = {
    # data
    "data.train_files": GroupInput("data"),
    "data.val_files": To("eval_dataset", source_list),
    "data.prompt_key": GroupInput("data"),
    "data.train_batch_size": To("rollout_batch_size"),  # prompts per step
    "data.val_batch_size": Skip("rlrun evaluates the whole eval set each time"),
    "data.max_prompt_length": GroupInput("turns"),
    "data.max_response_length": GroupInput("turns"),
    "data.filter_overlong_prompts": To("prompt_overflow", _overflow),
    "data.truncation": Skip(
        "rlrun drops overlong prompts (data.filter_overlong_prompts=True) or keeps their last tokens"
    ),
    "data.shuffle": Skip("rlrun always shuffles prompts, seeded by --seed"),
    "data.shuffle_train_dataloader": Skip("rlrun always shuffles prompts, seeded by --seed"),
    "data.seed": Skip("rlrun seeds the prompt order with --seed"),
    "data.train_data_num": To("max_samples"),  # Search-R1: cap on training prompts (null: all)
    "data.val_data_num": Skip(NOT_YET),
    "data.max_start_length": GroupInput("turns"),
    "data.max_obs_length": GroupInput("turns"),
    "data.return_raw_chat": Skip("rlrun keeps the raw prompt text for the reward anyway"),
    "data.return_raw_input_ids": Skip("rlrun keeps the raw prompt text for the reward anyway"),
    "data.tokenizer": Skip("rlrun uses the policy's tokenizer"),
    "data.trust_remote_code": Skip(NOT_YET),
    "data.image_key": To("image_key"),
    "data.reward_fn_key": GroupInput("data"),
    "data.apply_chat_template_kwargs": To("apply_chat_template_kwargs"),
    "data.dataloader_num_workers": Skip("rlrun reads the prompt file once, in each process"),
    "data.filter_overlong_prompts_workers": Skip("rlrun reads the prompt file once, in each process"),
    # models
    "actor_rollout_ref.model.path": To("pretrain"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": To("gradient_checkpointing"),
    "actor_rollout_ref.model.use_remove_padding": To("packing_samples"),
    "actor_rollout_ref.model.trust_remote_code": Skip(NOT_YET),
    "actor_rollout_ref.model.use_fused_kernels": Skip(NOT_YET),
    "actor_rollout_ref.model.use_shm": Skip(SHM),
    "actor_rollout_ref.model.external_lib": Skip(NOT_YET),
    # LoRA (verl's FSDP workers, PEFT): one rule, as rlrun has one adapter setting for actor and critic
    "actor_rollout_ref.model.lora_rank": GroupInput("lora"),
    "actor_rollout_ref.model.lora_alpha": GroupInput("lora"),
    "actor_rollout_ref.model.target_modules": GroupInput("lora"),
    "actor_rollout_ref.model.exclude_modules": GroupInput("lora"),
    "actor_rollout_ref.model.lora_adapter_path": Reject(ADAPTER_PATH),
    "actor_rollout_ref.hybrid_engine": Skip(
        "rlrun places engines by --vllm_num_engines (unset: on the actor's ranks, like verl's hybrid engine)"
    ),
    "actor_rollout_ref.nccl_timeout": To("dist_timeout"),
    "critic.model.path": To("critic_pretrain"),
    "critic.model.enable_gradient_checkpointing": Skip(
        SHARED.replace("actor_rollout_ref.actor", "actor_rollout_ref.model")
    ),
    "critic.model.use_remove_padding": To("packing_samples"),
    "critic.model.trust_remote_code": Skip(NOT_YET),
    "critic.model.tokenizer_path": Skip("rlrun uses the policy's tokenizer"),
    "critic.model.use_shm": Skip(SHM),
    "critic.model.lora_rank": GroupInput("lora"),
    "critic.model.lora_alpha": GroupInput("lora"),
    "critic.model.target_modules": GroupInput("lora"),
    "critic.model.lora_adapter_path": Reject(
        "rlrun starts the critic from a model directory (critic.model.path), not from a saved LoRA adapter"
    ),
    "reward_model.enable": GroupInput("data"),
    "reward_model.model.path": GroupInput("data"),
    "reward_model.micro_batch_size": Skip(ONE_MICRO),
    "reward_model.micro_batch_size_per_gpu": Skip(ONE_MICRO),
    "reward_model.reward_manager": Skip(
        "rlrun scores samples as verl's naive reward manager does (--reward_workers processes)"
    ),
    "reward_model.use_reward_loop": Skip("verl's reward managers are not used; rlrun takes --remote_rm_url"),
    "reward_model.num_workers": Skip("verl's reward managers are not used; rlrun takes --remote_rm_url"),
    "reward_model.structure_format_score": Skip(FORMAT_REWARD),
    "reward_model.final_format_score": Skip(FORMAT_REWARD),
    "reward_model.retrieval_score": Skip(FORMAT_REWARD),
    "custom_reward_function.path": GroupInput("data"),
    "custom_reward_function.name": GroupInput("data"),
    # actor optimisation
    A + "optim.lr": To("actor_learning_rate"),
    A + "optim.lr_warmup_steps_ratio": To("lr_warmup_ratio"),
    A + "optim.lr_warmup_steps": Skip(
        "rlrun sets warmup as a ratio: actor_rollout_ref.actor.optim.lr_warmup_steps_ratio"
    ),
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
    A + "ppo_mini_batch_size": GroupInput("batch"),
    A + "ppo_micro_batch_size": GroupInput("micro"),
    A + "ppo_micro_batch_size_per_gpu": To("micro_train_batch_size"),
    A + "clip_ratio": GroupInput("clip"),
    A + "clip_ratio_low": GroupInput("clip"),
    A + "clip_ratio_high": GroupInput("clip"),
    A + "clip_ratio_c": To("dual_clip"),
    A + "entropy_coeff": To("entropy_loss_coef"),
    A + "policy_loss.loss_mode": To("policy_loss_type", _loss_mode),
    A + "router_replay.mode": To("router_replay", _router_replay),
    A + "policy_loss.clip_cov_ratio": To("clip_cov_ratio"),
    A + "policy_loss.clip_cov_lb": GroupInput("cov"),
    A + "policy_loss.clip_cov_ub": GroupInput("cov"),
    A + "policy_loss.kl_cov_ratio": To("kl_cov_ratio"),
    A + "policy_loss.ppo_kl_coef": To("kl_cov_coef"),
    A + "policy_loss.dro_beta": To("dro_beta"),
    **{
        A + "policy_loss.rollout_correction." + k: Skip(ACTOR_RC)
        for k in (
            "rollout_is",
            "rollout_is_threshold",
            "rollout_is_batch_normalize",
            "rollout_rs",
            "rollout_rs_threshold",
            "bypass_mode",
            "loss_type",
        )
    },
    A + "tau_pos": To("sapo_tau_pos"),
    A + "tau_neg": To("sapo_tau_neg"),
    A + "loss_agg_mode": To("loss_agg_mode"),
    A + "use_kl_loss": GroupInput("kl"),
    A + "kl_loss_coef": GroupInput("kl"),
    A + "kl_loss_type": GroupInput("kl"),
    A + "use_dynamic_bsz": To("dynamic_batch", as_bool),
    A + "ppo_max_token_len_per_gpu": To("train_max_tokens_per_gpu"),
    A + "ulysses_sequence_parallel_size": GroupInput("sp"),
    A + "fsdp_config.ulysses_sequence_parallel_size": GroupInput("sp"),
    A + "use_torch_compile": Skip(NOT_YET),
    A + "strategy": Skip(FSDP2),
    A + "shuffle": Skip("rlrun always shuffles each rollout batch, seeded by --seed"),
    A + "state_masking": To("state_masking", as_bool),
    A + "freeze_vision_tower": To("freeze_visual_encoder", as_bool),
    # reference model
    "actor_rollout_ref.ref.log_prob_micro_batch_size": Skip(ONE_MICRO),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": Skip(ONE_MICRO),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": Skip(ONE_SWITCH),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": Skip(ONE_SCORING_BUDGET),
    REF + "ulysses_sequence_parallel_size": GroupInput("sp"),
    REF + "fsdp_config.ulysses_sequence_parallel_size": GroupInput("sp"),
    "actor_rollout_ref.ref.use_torch_compile": Skip(NOT_YET),
    "actor_rollout_ref.ref.strategy": Skip(FSDP2),
    # rollout
    R + "name": To("generation_backend", _backend),
    R + "n": GroupInput("batch"),
    R + "n_agent": GroupInput("batch"),  # Search-R1: the batch is repeated n_agent times before generation
    R + "temperature": To("temperature"),
    R + "top_p": To("top_p"),
    R + "top_k": Skip("rlrun samples without top-k"),
    R + "do_sample": Skip("rlrun always samples"),
    R + "tensor_model_parallel_size": To("vllm_tensor_parallel_size"),
    R + "gpu_memory_utilization": To("vllm_gpu_memory_utilization"),
    R + "enforce_eager": To("enforce_eager"),
    R + "free_cache_engine": Skip(VLLM_ONLY),
    # A memory knob of verl's LoRA weight sync (gather and merge the adapters layer by layer).
    R + "layered_summon": Skip(
        "rlrun merges the LoRA actor's adapters and sends the weights one FSDP unit at a time already"
    ),
    R + "log_prob_micro_batch_size": GroupInput("micro"),
    R + "log_prob_micro_batch_size_per_gpu": To("micro_rollout_batch_size"),
    R + "log_prob_use_dynamic_bsz": Skip(ONE_SWITCH),
    R + "log_prob_max_token_len_per_gpu": To("rollout_max_tokens_per_gpu"),
    R + "prompt_length": Skip("follows data.max_prompt_length"),
    R + "response_length": Skip("follows data.max_response_length"),
    R + "val_kwargs.temperature": To("eval_temperature"),
    R + "val_kwargs.n": To("eval_n_samples_per_prompt"),
    R + "val_kwargs.top_p": Skip(NOT_YET),
    R + "val_kwargs.top_k": Skip(NOT_YET),
    R + "val_kwargs.do_sample": Skip(NOT_YET),
    **{
        R + k: Skip(VLLM_ONLY)
        for k in (
            "mode",
            "dtype",
            "load_format",
            "enable_chunked_prefill",
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_model_len",
            "ignore_eos",
            "calculate_log_probs",
            "multi_stage_wake_up",
            "data_parallel_size",
            "expert_parallel_size",
            "disable_log_stats",
            "enable_prefix_caching",
        )
    },
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
    C + "use_dynamic_bsz": Skip(ONE_SWITCH),
    C + "ppo_max_token_len_per_gpu": Skip(SHARED),
    C + "forward_max_token_len_per_gpu": Skip(ONE_SCORING_BUDGET),
    C + "ulysses_sequence_parallel_size": GroupInput("sp"),
    C + "fsdp.ulysses_sequence_parallel_size": GroupInput("sp"),
    C + "strategy": Skip(FSDP2),
    C + "shuffle": Skip("rlrun always shuffles each rollout batch, seeded by --seed"),
    # algorithm
    "algorithm.adv_estimator": GroupInput("estimator"),
    "algorithm.norm_adv_by_std_in_grpo": GroupInput("estimator"),
    "algorithm.gamma": To("gamma"),
    "algorithm.lam": To("lambd"),
    "algorithm.use_kl_in_reward": GroupInput("kl"),
    "algorithm.kl_penalty": GroupInput("kl"),
    "algorithm.kl_ctrl.type": GroupInput("kl"),
    "algorithm.kl_ctrl.kl_coef": GroupInput("kl"),
    "algorithm.kl_ctrl.target_kl": GroupInput("kl"),
    "algorithm.kl_ctrl.horizon": GroupInput("kl"),
    "algorithm.no_think_rl": Skip("Search-R1 itself refuses no_think_rl (its generation raises ValueError)"),
    "algorithm.use_pf_ppo": Skip(NOT_YET),
    # rollout correction (verl's RolloutCorrectionConfig)
    RC + "rollout_is": To("rollout_is"),
    RC + "rollout_is_threshold": To("rollout_is_threshold", as_text),
    RC + "rollout_is_batch_normalize": To("rollout_is_batch_normalize", as_bool),
    RC + "rollout_rs": To("rollout_rs", option_list),
    RC + "rollout_rs_threshold": To("rollout_rs_threshold", as_text),
    RC + "bypass_mode": To("rollout_bypass", as_bool),
    RC + "loss_type": To("rollout_bypass_loss"),
    RC + "rollout_rs_threshold_lower": Reject(
        "verl removed it (#4544, 2026-01): give the lower bound in rollout_rs_threshold as LOW_HIGH"
    ),
    RC + "rollout_token_veto_threshold": Reject(
        "verl removed it (#4544, 2026-01): use rollout_rs=seq_max_k2 (or seq_max_k3) with a threshold"
    ),
    "algorithm.state_masking.start_state_marker": Skip(BY_PROVENANCE),
    "algorithm.state_masking.end_state_marker": Skip(BY_PROVENANCE),
    # on-policy distillation (verl's distillation.*: one teacher, scored by the policy-gradient or the loss form)
    D + "enabled": GroupInput("distill"),
    TEACHER + "model_path": GroupInput("distill"),
    D + "nnodes": GroupInput("distill"),
    D + "n_gpus_per_node": GroupInput("distill"),
    DL + "loss_mode": GroupInput("distill"),
    DL + "use_policy_gradient": GroupInput("distill"),
    DL + "use_task_rewards": GroupInput("distill"),
    DL + "distillation_loss_coef": GroupInput("distill"),
    DL + "loss_max_clamp": GroupInput("distill"),
    **{
        DL + k: Skip("used by verl's top-k modes only, which rlrun does not implement")
        for k in ("log_prob_min_clamp", "topk", "use_chunked_topk", "chunked_topk_chunk_size")
    },
    DL + "policy_loss_mode": Skip("the teacher term goes through the actor's own policy loss"),
    **{
        DL + k: Skip("the teacher term is clipped with the actor's clip range (one clip in rlrun)")
        for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high")
    },
    D + "teacher_key": Skip("rlrun distils from one teacher"),
    TEACHER + "key": Skip("rlrun distils from one teacher"),
    TEACHER + "num_replicas": Skip(SERVER_TEACHER),
    # trainer
    "trainer.total_epochs": To("num_episodes"),
    "trainer.total_training_steps": To("max_steps"),
    "trainer.save_freq": To("save_steps"),
    "trainer.test_freq": To("eval_steps"),
    "trainer.default_local_dir": To("ckpt_path"),
    "trainer.resume_mode": To("load_checkpoint", _resume),
    "trainer.resume_from_path": Skip("rlrun resumes from the newest complete checkpoint in trainer.default_local_dir"),
    "trainer.max_actor_ckpt_to_keep": To("max_ckpt_num"),
    "trainer.max_critic_ckpt_to_keep": Skip(
        "one rlrun checkpoint holds actor and critic: trainer.max_actor_ckpt_to_keep"
    ),
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
    # verl's fully-async trainer (verl/experimental/fully_async_policy)
    "async_training.partial_rollout": Expand(_fully_async),
    "async_training.staleness_threshold": Skip(
        FULLY_ASYNC + "bounds each sample's age in policy versions instead "
        "of verl's share of stale samples: --max_staleness (default 2)"
    ),
    "async_training.trigger_parameter_sync_step": Skip(FULLY_ASYNC + "syncs the engines' weights after every update"),
    "async_training.require_batches": Skip(FULLY_ASYNC + "trains one --rollout_batch_size batch per step"),
    "async_training.use_rollout_log_probs": Skip(
        FULLY_ASYNC + "takes the PPO ratio against the actor's recomputed "
        "log-probs (OpenRLHF's way); the engine's feed --is_correction_level"
    ),
    "async_training.compute_prox_log_prob": Skip(FULLY_ASYNC + "always recomputes the actor's log-probs"),
    "rollout.nnodes": Skip("rlrun places the engines with --vllm_num_engines (and --vllm_tensor_parallel_size)"),
    "rollout.n_gpus_per_node": Skip(
        "rlrun places the engines with --vllm_num_engines (and --vllm_tensor_parallel_size)"
    ),
    "rollout.total_rollout_steps": Skip("rlrun's steps: trainer.total_training_steps (--max_steps)"),
    "trainer.del_local_ckpt_after_load": Skip(NOT_YET),
    "trainer.ray_wait_register_center_timeout": Skip(RAY_ONLY),
    # Search-R1 top-level keys
    "max_turns": GroupInput("turns"),
    "do_search": GroupInput("turns"),
    "retriever.url": GroupInput("data"),
    "retriever.topk": To("retriever_topk"),
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
    # verl's Megatron backend's LoRA block (model.lora.rank is refused: reasons.CHANGES_TRAINING)
    "lora": "verl's Megatron-backend LoRA settings; rlrun's LoRA: actor_rollout_ref.model.lora_rank, lora_alpha, "
    "target_modules",
    "ray_kwargs": RAY_ONLY,
    "ray_init": RAY_ONLY,
    "sandbox_fusion": "verl's reward managers are not used; rlrun takes --remote_rm_url",
    "reward_kwargs": "verl's reward managers are not used; rlrun takes --remote_rm_url",
    "pf_ppo": NOT_YET,
    "filter_groups": NOT_YET,
}


def meaning_of(key: str) -> Meaning | None:
    if key in VERL_KEYS:
        return VERL_KEYS[key]
    if key.startswith(TEACHER + "inference."):
        return Skip(SERVER_TEACHER)
    if key.startswith(D + "teacher_models.") and not key.startswith(TEACHER):
        return Reject(
            "rlrun distils from one teacher: give it as distillation.teacher_models.teacher_model.model_path "
            "(routing samples to several teachers by distillation.teacher_key is not implemented)"
        )
    for segment in key.split("."):
        if segment in SKIPPED_SUBTREES:
            return Skip(SKIPPED_SUBTREES[segment])
    return None
