"""OpenRLHF 0.11 flags of ``train_sft``, ``train_rm`` and ``train_dpo`` -> the flags of rlrun.sft, rlrun.rm, rlrun.dpo.

Data tables for ``openrlhf_flags.translate(..., table=...)``, in its terms (``Same``, ``ByValue``, ``Ignored``):

- ``SFT_DOTTED``, ``RM_DOTTED``, ``DPO_DOTTED``: every dotted flag of 0.11.2's ``openrlhf/cli/train_sft.py``,
  ``train_rm.py`` and ``train_dpo.py``. A flag these trainers share with ``train_ppo_ray`` and that means
  the same there is PPO's own entry (``OPENRLHF_DOTTED``), taken by name, never written twice; so are the
  AdamW/Muon flags (``adam_muon_flags``, unprefixed here).
- ``SFT_IGNORED``, ``RM_IGNORED``, ``DPO_IGNORED``: the classic (OpenRLHF <= 0.10, underscore) flag names of
  those trainers that rlrun accepts and reports without acting on, as ``cli.IGNORED_FLAGS``
  (name -> (nargs, reason)). Every ``Same`` target that is not a field of the trainer is here, so its dotted
  spelling is reported with the same reason (``resolve``). The undotted flags 0.11.2 kept (``--optim``,
  ``--lr_scheduler``, ``--min_lr_ratio``, ``--local_rank``, ``--use_ms``; ``--lr_warmup_ratio`` and
  ``--max_norm`` are fields) are classic flags too.
"""

from __future__ import annotations

from typing import Mapping

from rlrun.compat.openrlhf_flags import (MIN_LR_RATIO, OPENRLHF_DOTTED, Ignored, Meaning, Same,
                                         adam_muon_flags)
from rlrun.compat.reasons import LAUNCHER, NOT_YET, QLORA

Classic = Mapping[str, tuple[int | str, str]]


def _ppo(*names: str) -> dict[str, Meaning]:
    """train_ppo_ray's entries for flags that mean the same in the supervised trainers (one definition each)."""
    return {name: OPENRLHF_DOTTED[name] for name in names}


# Flags of all three trainers.
_COMMON: dict[str, Meaning] = {
    **_ppo(
        # checkpoints, logging, evaluation
        "ckpt.output_dir", "ckpt.save_steps", "ckpt.save_hf", "ckpt.disable_ds", "ckpt.path", "ckpt.max_num",
        "ckpt.max_mem", "ckpt.load_enable", "ds.use_universal_ckpt", "logger.logging_steps", "logger.wandb.key",
        "logger.wandb.org", "logger.wandb.group", "logger.wandb.project", "logger.wandb.run_name",
        "logger.tensorboard_dir", "eval.steps", "eval.dataset", "eval.split",
        # batches, schedule, strategy
        "train.micro_batch_size", "train.batch_size", "train.max_epochs", "train.seed",
        "train.full_determinism_enable", "ds.zero_stage", "ds.param_dtype", "ds.zpg", "ds.adam_offload",
        "ds.deepcompile", "ds.attn_implementation", "ds.experts_implementation", "ds.grad_accum_dtype",
        "ds.overlap_comm", "ds.tensor_parallel_size", "ds.ring_attn_size", "ds.ring_attn_head_stride",
        "ds.packing_samples", "ds.load_in_4bit", "ds.lora.rank", "ds.lora.alpha", "ds.lora.dropout",
        "ds.lora.target_modules",
        # data
        "data.max_len", "data.max_samples", "data.input_template", "data.apply_chat_template",
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
    "aux_loss_coef": (1, "the MoE load-balancing loss is not implemented in rlrun yet; it has no effect"),
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
    "ring_attn_size": (1, NOT_YET),
    "ring_head_stride": (1, NOT_YET),
    "load_in_4bit": (0, QLORA),  # refused (reasons.CHANGES_TRAINING); the LoRA flags are fields
}

SFT_IGNORED: dict[str, tuple[int | str, str]] = {
    **_COMMON_IGNORED,
    "use_liger_kernel": (0, NOT_YET),
    "multiturn": (0, "multi-turn loss masks (every assistant turn) are not implemented in rlrun yet; it has no effect"),
}

RM_IGNORED: dict[str, tuple[int | str, str]] = {
    **_COMMON_IGNORED,
    "value_head_prefix": (1, "rlrun's reward model is a transformers sequence-classification model with its own head "
                             "('score' for causal LMs, OpenRLHF's default name)"),
    "compute_fp32_loss": (0, "rlrun always computes the reward-model loss in fp32"),
}

DPO_IGNORED: dict[str, tuple[int | str, str]] = {
    **_COMMON_IGNORED,
    "use_liger_kernel": (0, NOT_YET),
}
