"""OpenRLHF 0.11 dotted flags (``--actor.num_nodes``, ``--algo.kl.init_coef``) -> rlrun's flags.

OpenRLHF <= 0.9 spelled every ``train_ppo_ray`` flag with underscores; rlrun's fields carry those classic
names. 0.11.2 renamed them all into dotted sections. ``OPENRLHF_DOTTED`` lists every dotted flag of
0.11.2's ``openrlhf/cli/train_ppo_ray.py`` with what it means here, read from how OpenRLHF uses it:

- ``Same(field, nargs)``: the rlrun field (= the classic flag) of the same meaning. If that field does not
  exist (yet), the classic name's IGNORED_FLAGS entry, or else "not implemented yet", is reported instead.
- ``ByValue(tokens, fix)``: a one-value flag whose accepted values stand for rlrun flag tokens.
- ``Ignored(nargs, reason)``: accepted, consumed and reported with the reason.

``translate`` rewrites argv accordingly, before argparse sees it, so later flags still win.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rlrun.compat.argv import LAUNCHER, NOT_YET, QLORA, RING_HEAD_STRIDE, Nargs, refused, take_values
from rlrun.config.fields import FieldInfo, coerce, suggest
from rlrun.runtime.errors import ConfigError


@dataclass(frozen=True)
class Same:
    """Means rlrun's field `field` (OpenRLHF's classic flag name); takes `nargs` values (0: store_true)."""

    field: str
    nargs: Nargs
    # OpenRLHF reads one value of a LOW HIGH pair as HIGH with LOW 0 (--algo.advantage.is_correction_threshold).
    single_value_is_high: bool = False


@dataclass(frozen=True)
class ByValue:
    """A one-value flag: each accepted value stands for these rlrun flag tokens; other values fail with `fix`."""

    tokens: Mapping[str, tuple[str, ...]]
    fix: str


@dataclass(frozen=True)
class Ignored:
    nargs: Nargs
    reason: str


Meaning = Same | ByValue | Ignored

SHARED = "rlrun uses one value for actor and critic; set it with the --actor.* flag"
MUON = "only used with --{optim} muon; rlrun trains with AdamW only"
MIN_LR_RATIO = "rlrun's cosine schedule decays to 0.1 x lr, OpenRLHF's default"


def adam_muon_flags(prefix: str, lr_field: str, *, critic_copy: bool = False) -> dict[str, Meaning]:
    """--{prefix}muon.* and --{prefix}adam.*: prefix 'actor.'/'critic.' (train_ppo_ray), '' (train_sft/rm/dpo).

    rlrun trains with AdamW only. critic_copy: the betas and weight decay are the actor's (PPO's critic)."""
    muon = MUON.format(optim=f"{prefix}optim")
    return {
        f"{prefix}muon.lr": Ignored(1, muon),
        f"{prefix}muon.momentum": Ignored(1, muon),
        f"{prefix}muon.ns_steps": Ignored(1, muon),
        f"{prefix}muon.nesterov": Ignored(0, muon),
        f"{prefix}muon.no_nesterov": Ignored(0, muon),
        f"{prefix}adam.lr": Same(lr_field, 1),
        f"{prefix}adam.betas": Ignored(2, SHARED) if critic_copy else Same("adam_betas", 2),
        f"{prefix}adam.eps": Ignored(1, "rlrun's AdamW uses eps 1e-8, OpenRLHF's default"),
        f"{prefix}adam.weight_decay": Ignored(1, SHARED) if critic_copy else Same("l2", 1),
    }


def _optimizer(role: str) -> dict[str, Meaning]:
    """--{actor,critic}.{optim,muon.*,adam.*,lr_*,max_norm}: rlrun has one AdamW setting for both roles."""
    actor = role == "actor"
    return {
        f"{role}.optim": ByValue({"adam": ()}, "rlrun trains with AdamW only: drop the flag or pass adam"),
        **adam_muon_flags(f"{role}.", f"{role}_learning_rate", critic_copy=not actor),
        # OpenRLHF 0.9's single --lr_scheduler became one per role; rlrun's schedule is fixed.
        f"{role}.lr_scheduler": Same("lr_scheduler", 1),
        f"{role}.lr_warmup_ratio": Same("lr_warmup_ratio", 1) if actor else Ignored(1, SHARED),
        f"{role}.min_lr_ratio": Ignored(1, MIN_LR_RATIO),
        f"{role}.max_norm": Same("max_norm", 1) if actor else Ignored(1, SHARED),
    }


OPENRLHF_DOTTED: dict[str, Meaning] = {
    # role layout ('gpus' are ranks)
    "actor.num_nodes": Same("actor_num_nodes", 1),
    "actor.num_gpus_per_node": Same("actor_num_gpus_per_node", 1),
    "critic.num_nodes": Same("critic_num_nodes", 1),
    "critic.num_gpus_per_node": Same("critic_num_gpus_per_node", 1),
    "ref.num_nodes": Same("ref_num_nodes", 1),
    "ref.num_gpus_per_node": Same("ref_num_gpus_per_node", 1),
    "reward.num_nodes": Same("reward_num_nodes", 1),
    "reward.num_gpus_per_node": Same("reward_num_gpus_per_node", 1),
    "train.colocate_actor_ref": Same("colocate_actor_ref", 0),
    "train.colocate_critic_reward": Same("colocate_critic_reward", 0),
    "train.colocate_all": Same("colocate_all_models", 0),
    # generation engines
    "vllm.num_engines": Same("vllm_num_engines", 1),
    "vllm.tensor_parallel_size": Same("vllm_tensor_parallel_size", 1),
    "vllm.sync_backend": Same("vllm_sync_backend", 1),
    "vllm.sync_with_ray": Same("vllm_sync_with_ray", 0),
    "vllm.enable_prefix_caching": Same("enable_prefix_caching", 0),
    "vllm.enforce_eager": Same("enforce_eager", 0),
    "vllm.enable_sleep": Same("vllm_enable_sleep", 0),
    "vllm.gpu_memory_utilization": Same("vllm_gpu_memory_utilization", 1),
    # train/rollout logprob-mismatch importance sampling (0.9: --enable_vllm_is_correction)
    "algo.advantage.is_correction_level": Same("is_correction_level", 1),
    "algo.advantage.is_correction_mode": Same("is_correction_mode", 1),
    "algo.advantage.is_correction_gating": Same("is_correction_gating", 1),
    "algo.advantage.is_correction_threshold": Same("is_correction_threshold", "+", single_value_is_high=True),
    # async training
    "train.async_enable": Same("async_train", 0),
    "train.async_queue_size": Same("async_queue_size", 1),
    "train.partial_rollout_enable": Same("partial_rollout", 0),
    # checkpoints and evaluation
    "eval.steps": Same("eval_steps", 1),
    "ckpt.save_steps": Same("save_steps", 1),
    "logger.logging_steps": Same("logging_steps", 1),
    "ckpt.path": Same("ckpt_path", 1),
    "ckpt.save_hf": Same("save_hf_ckpt", 0),
    "ckpt.disable_ds": Same("disable_ds_ckpt", 0),
    "ckpt.max_num": Same("max_ckpt_num", 1),
    "ckpt.max_mem": Same("max_ckpt_mem", 1),
    "ckpt.load_enable": Same("load_checkpoint", 0),
    "ckpt.best_metric_key": Ignored(1, NOT_YET),
    "ckpt.output_dir": Same("save_path", 1),  # where the final HF model goes (0.9: --save_path)
    "ds.use_universal_ckpt": Same("use_ds_universal_ckpt", 0),
    # training strategy (DeepSpeed in OpenRLHF; in rlrun FSDP2 by default, DeepSpeed ZeRO-0/1/2/3 with
    # --strategy deepspeed)
    "ds.zero_stage": Same("zero_stage", 1),
    "ds.deepcompile": Same("deepcompile", 0),
    # 0.11 dropped --bf16 for --ds.param_dtype (default bf16); rlrun has bf16 or fp32, no fp16.
    "ds.param_dtype": ByValue(
        {"bf16": ("--bf16", "true")},
        "rlrun trains in bf16 (--ds.param_dtype bf16) or fp32 (drop the flag); fp16 is not supported",
    ),
    "ds.zpg": Same("zpg", 1),
    "ds.adam_offload": Same("adam_offload", 0),
    "ds.attn_implementation": Same("attn_implementation", 1),
    "ds.experts_implementation": Ignored(1, NOT_YET),
    "ds.use_liger_kernel": Same("use_liger_kernel", 0),
    "ds.grad_accum_dtype": Same("grad_accum_dtype", 1),
    "ds.overlap_comm": Same("overlap_comm", 0),
    "ds.enable_sleep": Same("sleep", 0),
    "ds.tensor_parallel_size": Same("ds_tensor_parallel_size", 1),
    "ds.packing_samples": Same("packing_samples", 0),
    "ds.load_in_4bit": Same("load_in_4bit", 0),
    "ds.lora.rank": Same("lora_rank", 1),
    "ds.lora.alpha": Same("lora_alpha", 1),
    "ds.lora.target_modules": Same("target_modules", "*"),
    "ds.lora.dropout": Same("lora_dropout", 1),
    "ds.ring_attn_size": Same("sequence_parallel_size", 1),
    "ds.ring_attn_head_stride": Same("ring_head_stride", 1),
    "ds.value_head_prefix": Same("value_head_prefix", 1),
    "actor.gradient_checkpointing_enable": Same("gradient_checkpointing", 0),
    "actor.gradient_checkpointing_reentrant": Same("gradient_checkpointing_use_reentrant", 0),
    "train.enable_ema": Same("enable_ema", 0),
    "train.ema_beta": Same("ema_beta", 1),
    "train.dynamic_batch_enable": Same("dynamic_batch", 0),  # classic --use_dynamic_batch (cli.parser.RENAMED_FLAGS)
    "rollout.max_tokens_per_gpu": Same("rollout_max_tokens_per_gpu", 1),
    "train.max_tokens_per_gpu": Same("train_max_tokens_per_gpu", 1),
    "data.disable_fast_tokenizer": Same("disable_fast_tokenizer", 0),
    "data.dataloader_num_workers": Ignored(1, "rlrun reads the prompt file once, in each process; no loader workers"),
    # batches and schedule
    "train.num_episodes": Same("num_episodes", 1),
    "rollout.batch_size": Same("rollout_batch_size", 1),
    "rollout.vllm_generate_batch_size": Same("vllm_generate_batch_size", 1),
    "rollout.micro_batch_size": Same("micro_rollout_batch_size", 1),
    "train.max_epochs": Same("max_epochs", 1),
    "train.micro_batch_size": Same("micro_train_batch_size", 1),
    "train.batch_size": Same("train_batch_size", 1),
    "rollout.n_samples_per_prompt": Same("n_samples_per_prompt", 1),
    "data.max_len": Same("max_len", 1),  # total prompt + response window (0.9: --max_len)
    "rollout.max_new_tokens": Same("generate_max_len", 1),
    "data.max_samples": Same("max_samples", 1),
    "rollout.top_p": Same("top_p", 1),
    "rollout.temperature": Same("temperature", 1),
    "train.seed": Same("seed", 1),
    "train.full_determinism_enable": Same("full_determinism", 0),
    "critic.freezing_steps": Same("freezing_actor_steps", 1),  # steps that train only the critic
    # policy and value losses
    "actor.eps_clip": Same("eps_clip", 1),
    "actor.eps_clip_low_high": Same("eps_clip_low_high", 2),
    "actor.dual_clip": Same("dual_clip", 1),
    "critic.value_clip": Same("value_clip", 1),
    "actor.policy_loss_type": Same("policy_loss_type", 1),
    "actor.loss_agg_mode": Same("loss_agg_mode", 1),
    "actor.aux_loss_coef": Same("aux_loss_coef", 1),
    "actor.entropy_coef": Same("entropy_loss_coef", 1),
    "critic.save_value_network": Same("save_value_network", 0),
    # advantages, KL, rewards
    "algo.advantage.estimator": Same("advantage_estimator", 1),
    "algo.advantage.lambd": Same("lambd", 1),
    "algo.advantage.gamma": Same("gamma", 1),
    "algo.advantage.no_std_norm": Same("no_advantage_std_norm", 0),
    "algo.kl.use_loss": Same("use_kl_loss", 0),
    "algo.kl.target": Same("kl_target", 1),
    "algo.kl.horizon": Same("kl_horizon", 1),
    "algo.kl.init_coef": Same("init_kl_coef", 1),
    "algo.kl.estimator": Same("kl_estimator", 1),
    "algo.kl.unbiased_gradient": Ignored(0, NOT_YET),
    "algo.dynamic_filtering_enable": Same("dynamic_filtering", 0),
    "algo.dynamic_filtering_range": Same("dynamic_filtering_reward_range", 2),
    "reward.normalize_enable": Same("normalize_reward", 0),
    "reward.clip_range": Same("reward_clip_range", 2),
    "reward.overlong_buffer_len": Same("overlong_buffer_len", 1),
    "reward.overlong_penalty_factor": Same("overlong_penalty_factor", 1),
    "reward.stop_properly_penalty_coef": Same("stop_properly_penalty_coef", 1),
    # models and reward sources
    "actor.model_name_or_path": Same("pretrain", 1),
    "reward.model_name_or_path": Same("reward_pretrain", 1),
    "reward.remote_url": Same("remote_rm_url", 1),
    "critic.model_name_or_path": Same("critic_pretrain", 1),
    "ref.offload": Same("ref_reward_offload", 0),
    "reward.offload": Same("ref_reward_offload", 0),
    "train.agent_func_path": Same("agent_func_path", 1),
    # data
    "data.prompt_dataset": Same("prompt_data", 1),
    "data.prompt_probs": Same("prompt_data_probs", 1),
    "data.prompt_split": Same("prompt_split", 1),
    "eval.dataset": Same("eval_dataset", 1),
    "eval.split": Same("eval_split", 1),
    "eval.temperature": Same("eval_temperature", 1),
    "eval.n_samples_per_prompt": Same("eval_n_samples_per_prompt", 1),
    "data.input_key": Same("input_key", 1),
    "data.label_key": Same("label_key", 1),
    "data.input_template": Same("input_template", 1),
    "data.apply_chat_template": Same("apply_chat_template", 0),
    # vision-language models
    "data.image_key": Same("image_key", 1),
    "data.max_images_per_prompt": Same("max_images_per_prompt", 1),
    "actor.freeze_visual_encoder": Same("freeze_visual_encoder", 0),
    # loggers
    "logger.wandb.key": Same("use_wandb", 1),
    "logger.wandb.org": Same("wandb_org", 1),
    "logger.wandb.group": Same("wandb_group", 1),
    "logger.wandb.project": Same("wandb_project", 1),
    "logger.wandb.run_name": Same("wandb_run_name", 1),
    "logger.tensorboard_dir": Same("use_tensorboard", 1),
    **_optimizer("actor"),
    **_optimizer("critic"),
}

# Dotted flags of OpenRLHF 0.10.2-0.11.0 that 0.11.2 replaced (its --algo.advantage.is_correction_level/mode/gating);
# their meaning is the same correction (rlrun.plan.checks.openrlhf_settings).
EARLIER_DOTTED: dict[str, Meaning] = {
    "algo.advantage.is_correction_enable": Same("enable_vllm_is_correction", 0),
    "algo.advantage.is_correction_type": Same("vllm_is_correction_type", 1),
}

# The two undotted flags 0.11.2 still has (--local_rank, --use_ms) are classic flags: rlrun.cli.parser.IGNORED_FLAGS.


@dataclass(frozen=True)
class Translated:
    argv: list[str]  # rlrun (classic) flags only
    ignored: list[str]  # one report line per ignored dotted flag


def resolve(
    dotted: str,
    fields: Mapping[str, FieldInfo],
    classic_ignored: Mapping[str, tuple[int | str, str]],
    table: Mapping[str, Meaning] = OPENRLHF_DOTTED,
) -> Meaning:
    """What a table entry means in this build: a Same whose field is missing becomes Ignored."""
    meaning = table[dotted]
    if isinstance(meaning, Same) and meaning.field not in fields:
        # Another part of rlrun may not have implemented the field yet: say so, never fail.
        reason = classic_ignored[meaning.field][1] if meaning.field in classic_ignored else NOT_YET
        return Ignored(meaning.nargs, reason)
    return meaning


def all_spellings(
    fields: Mapping[str, FieldInfo],
    classic_ignored: Mapping[str, object],
    table: Mapping[str, Meaning] = OPENRLHF_DOTTED,
) -> list[str]:
    """Every flag name rlrun accepts (without '--'): classic, rlrun's section.field aliases, OpenRLHF dotted."""
    return [*fields, *classic_ignored, *(f"{i.section}.{n}" for n, i in fields.items()), *table]


def translate(
    argv: Sequence[str],
    fields: Mapping[str, FieldInfo],
    classic_ignored: Mapping[str, tuple[int | str, str]],
    table: Mapping[str, Meaning] = OPENRLHF_DOTTED,
) -> Translated:
    """Rewrite dotted flags (OpenRLHF 0.11's `table` for this trainer, and rlrun's own --section.field) into
    classic flags.

    A dotted flag that is neither is a ConfigError with a suggestion over both spellings.
    """
    out: list[str] = []
    ignored: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        head, eq, value = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if "." not in head:
            out.append(token)
            continue
        flag = f"--{head}"
        if head not in table:
            section, _, name = head.partition(".")
            if name in fields and fields[name].section == section:  # rlrun's own alias, e.g. --train.seed
                out.append(f"--{name}{eq}{value}")
                continue
            raise ConfigError(
                f"unknown flag '{flag}'{suggest(head, all_spellings(fields, classic_ignored, table), prefix='--')}"
            )
        meaning = resolve(head, fields, classic_ignored, table)
        nargs: Nargs = 1 if isinstance(meaning, ByValue) else meaning.nargs
        if eq:
            values = [value]
        else:
            values = take_values(argv, i, nargs, flag) if nargs != 0 else []
            i += len(values)
        if isinstance(meaning, Ignored):
            original = table[head]
            name = f"--{original.field}" if isinstance(original, Same) else flag
            if (stop := refused([(name, values[0] if values else None)])) is not None:
                raise ConfigError(stop.replace(name, flag, 1))
            ignored.append(f"{flag}: ignored ({meaning.reason})")
        elif isinstance(meaning, ByValue):
            if values[0] not in meaning.tokens:
                raise ConfigError(f"{flag} {values[0]}: {meaning.fix}")
            out.extend(meaning.tokens[values[0]])
        else:
            info = fields[meaning.field]
            if not values and meaning.nargs == "*":
                # OpenRLHF's nargs="*" reads a bare --ds.lora.target_modules as an empty list, which PEFT cannot adapt.
                raise ConfigError(f"{flag} needs at least one value (module names like q_proj v_proj, or all-linear)")
            if meaning.single_value_is_high and len(values) == 1:
                values = ["0", *values] if not eq else ["0", value]
                eq = ""  # two values now: passed as separate tokens
            if values:  # check here so that a bad value is reported under the name the user typed
                coerce(info, values if len(values) > 1 else values[0], flag)
            out.extend([f"--{meaning.field}={values[0]}"] if eq else [f"--{meaning.field}", *values])
    return Translated(out, ignored)


# ---- the supervised trainers' flags ------------------------------------------------------------------------------
# OpenRLHF 0.11 flags of ``train_sft``, ``train_rm`` and ``train_dpo`` -> the flags of rlrun.sft, rlrun.rm, rlrun.dpo.
#
# Data tables for ``openrlhf_flags.translate(..., table=...)``, in its terms (``Same``, ``ByValue``, ``Ignored``):
#
# - ``SFT_DOTTED``, ``RM_DOTTED``, ``DPO_DOTTED``: every dotted flag of 0.11.2's ``openrlhf/cli/train_sft.py``,
#   ``train_rm.py`` and ``train_dpo.py``. A flag these trainers share with ``train_ppo_ray`` and that means
#   the same there is PPO's own entry (``OPENRLHF_DOTTED``), taken by name, never written twice; so are the
#   AdamW/Muon flags (``adam_muon_flags``, unprefixed here).
# - ``SFT_IGNORED``, ``RM_IGNORED``, ``DPO_IGNORED``: the classic (OpenRLHF <= 0.10, underscore) flag names of
#   those trainers that rlrun accepts and reports without acting on, as ``cli.IGNORED_FLAGS``
#   (name -> (nargs, reason)). Every ``Same`` target that is not a field of the trainer is here, so its dotted
#   spelling is reported with the same reason (``resolve``). The undotted flags 0.11.2 kept (``--optim``,
#   ``--lr_scheduler``, ``--min_lr_ratio``, ``--local_rank``, ``--use_ms``; ``--lr_warmup_ratio`` and
#   ``--max_norm`` are fields) are classic flags too.

Classic = Mapping[str, tuple[int | str, str]]


def _ppo(*names: str) -> dict[str, Meaning]:
    """train_ppo_ray's entries for flags that mean the same in the supervised trainers (one definition each)."""
    return {name: OPENRLHF_DOTTED[name] for name in names}


# Flags of all three trainers.
_COMMON: dict[str, Meaning] = {
    **_ppo(
        # checkpoints, logging, evaluation
        "ckpt.output_dir",
        "ckpt.save_steps",
        "ckpt.save_hf",
        "ckpt.disable_ds",
        "ckpt.path",
        "ckpt.max_num",
        "ckpt.max_mem",
        "ckpt.load_enable",
        "ds.use_universal_ckpt",
        "logger.logging_steps",
        "logger.wandb.key",
        "logger.wandb.org",
        "logger.wandb.group",
        "logger.wandb.project",
        "logger.wandb.run_name",
        "logger.tensorboard_dir",
        "eval.steps",
        "eval.dataset",
        "eval.split",
        # batches, schedule, strategy
        "train.micro_batch_size",
        "train.batch_size",
        "train.max_epochs",
        "train.seed",
        "train.full_determinism_enable",
        "ds.zero_stage",
        "ds.param_dtype",
        "ds.zpg",
        "ds.adam_offload",
        "ds.deepcompile",
        "ds.attn_implementation",
        "ds.experts_implementation",
        "ds.grad_accum_dtype",
        "ds.overlap_comm",
        "ds.tensor_parallel_size",
        "ds.ring_attn_size",
        "ds.ring_attn_head_stride",
        "ds.packing_samples",
        "ds.load_in_4bit",
        "ds.lora.rank",
        "ds.lora.alpha",
        "ds.lora.dropout",
        "ds.lora.target_modules",
        # data
        "data.max_len",
        "data.max_samples",
        "data.input_template",
        "data.apply_chat_template",
        "data.disable_fast_tokenizer",
    ),
    "model.model_name_or_path": Same("pretrain", 1),
    "model.gradient_checkpointing_enable": Same("gradient_checkpointing", 0),
    "model.gradient_checkpointing_reentrant": Same("gradient_checkpointing_use_reentrant", 0),
    "model.aux_loss_coef": Same("aux_loss_coef", 1),
    "data.dataset": Same("dataset", 1),
    "data.dataset_probs": Same("dataset_probs", 1),
    "data.tokenizer_chat_template": Same("tokenizer_chat_template", 1),
    # OpenRLHF picks the split of a DatasetDict; reading another split than asked would train or evaluate on
    # the wrong records, so any other value is an error rather than a report.
    "data.dataset_split": Same("dataset_split", 1),
    "data.dataloader_num_workers": Ignored(1, "rlrun reads the dataset once, in each process; no loader workers"),
    **adam_muon_flags("", "learning_rate"),
}

_PAIR_DATA: dict[str, Meaning] = {
    "data.prompt_key": Same("prompt_key", 1),
    "data.chosen_key": Same("chosen_key", 1),
    "data.rejected_key": Same("rejected_key", 1),
}

SFT_DOTTED: dict[str, Meaning] = {
    **_COMMON,
    **_ppo("data.input_key", "ds.use_liger_kernel"),
    "data.output_key": Same("output_key", 1),
    "data.multiturn": Same("multiturn", 0),
    "model.pretrain_mode_enable": Same("pretrain_mode", 0),
}

RM_DOTTED: dict[str, Meaning] = {
    **_COMMON,
    **_PAIR_DATA,
    **_ppo("ds.value_head_prefix"),
    "model.loss_type": Same("loss", 1),
    "model.margin_loss_enable": Same("margin_loss", 0),
    "model.compute_fp32_loss_enable": Same("compute_fp32_loss", 0),
}

DPO_DOTTED: dict[str, Meaning] = {
    **_COMMON,
    **_PAIR_DATA,
    **_ppo("ds.use_liger_kernel"),
    "model.beta": Same("beta", 1),
    "model.ipo_enable": Same("ipo", 0),
    "model.label_smoothing": Same("label_smoothing", 1),
    "model.nll_loss_coef": Same("nll_loss_coef", 1),
    "ref.model_name_or_path": Same("ref_pretrain", 1),
    "ref.offload": Same("ref_offload", 0),  # train_ppo_ray's --ref.offload is PPO's ref_reward_offload
}


# Classic flags of all three trainers (OpenRLHF <= 0.10 spellings, and the undotted flags 0.11.2 kept).
_COMMON_IGNORED: dict[str, tuple[int | str, str]] = {
    "local_rank": (1, LAUNCHER),
    "optim": (1, "rlrun trains with AdamW only (OpenRLHF's default --optim adam); Muon is not implemented"),
    "lr_scheduler": (1, "rlrun always uses linear warmup + cosine decay"),
    "min_lr_ratio": (1, MIN_LR_RATIO),
    "full_determinism": (0, "rlrun is deterministic on CPU by default"),
    "use_ms": (0, "ModelScope hub: rlrun reads local paths and Hugging Face Hub ids"),
    "save_hf_ckpt": (0, NOT_YET),
    "disable_ds_ckpt": (0, NOT_YET),
    "max_ckpt_mem": (1, NOT_YET),
    "use_ds_universal_ckpt": (0, NOT_YET),
    "deepcompile": (0, NOT_YET),
    "zpg": (1, NOT_YET),
    "grad_accum_dtype": (1, NOT_YET),
    "overlap_comm": (0, NOT_YET),
    "ds_tensor_parallel_size": (1, NOT_YET),
    "gradient_checkpointing_use_reentrant": (0, NOT_YET),
    "disable_fast_tokenizer": (0, NOT_YET),
    "ring_head_stride": (1, RING_HEAD_STRIDE),
    "load_in_4bit": (0, QLORA),  # refused (reasons.CHANGES_TRAINING); the LoRA flags are fields
}

# Classic flags of all three trainers spelled differently in rlrun: OpenRLHF's ring attention groups act as
# rlrun's Ulysses sequence parallelism (the dotted ds.ring_attn_size too).
SUPERVISED_RENAMED: dict[str, str] = {"ring_attn_size": "sequence_parallel_size"}

SFT_IGNORED: dict[str, tuple[int | str, str]] = {
    **_COMMON_IGNORED,
    "use_liger_kernel": (0, NOT_YET),
    "multiturn": (0, "multi-turn loss masks (every assistant turn) are not implemented in rlrun yet; it has no effect"),
}

_NO_AUX = (1, "the MoE load-balancing loss is implemented for rlrun.ppo and rlrun.sft only; it has no effect here")

RM_IGNORED: dict[str, tuple[int | str, str]] = {
    **_COMMON_IGNORED,
    "aux_loss_coef": _NO_AUX,
    "value_head_prefix": (
        1,
        "rlrun's reward model is a transformers sequence-classification model with its own head "
        "('score' for causal LMs, OpenRLHF's default name)",
    ),
    "compute_fp32_loss": (0, "rlrun always computes the reward-model loss in fp32"),
}

DPO_IGNORED: dict[str, tuple[int | str, str]] = {
    **_COMMON_IGNORED,
    "aux_loss_coef": _NO_AUX,
    "use_liger_kernel": (0, NOT_YET),
}
