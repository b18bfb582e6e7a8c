"""The model sections: the model being trained and how it runs (every trainer: `PretrainedConfig`), and rlrun.ppo's
other models and reward sources (`ModelConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlrun.config.fields import opt


@dataclass
class PretrainedConfig:
    """The model being trained: where it comes from and how it runs (every trainer)."""

    pretrain: str | None = opt(
        None, "Model to train: a local HF directory. Unset: the embedded tiny model (see --model_preset)."
    )
    model_preset: Literal["tiny", "3m", "100m", "0.5b", "tiny-vl"] = opt(
        "tiny",
        "Random-init model shape used when "
        "--pretrain is unset (offline demo "
        "and benchmarks). tiny-vl "
        "(rlrun.ppo): a tiny Qwen2.5-VL and, "
        "without --prompt_data, its image "
        "task (configs/vlm_demo.yaml), built "
        "into RLRUN_CACHE (default "
        "~/.cache/rlrun) on first use.",
    )
    bf16: bool = opt(False, "bf16 mixed precision (on GPU; CPU training stays fp32).")
    flash_attn: bool = opt(False, "Use flash-attention 2 (needs the flash-attn extra and a GPU).")
    attn_implementation: str | None = opt(None, "HF attn_implementation override (eager, sdpa, flash_attention_2).")
    gradient_checkpointing: bool = opt(False, "Recompute activations in the backward pass to save memory.")
    lora_rank: int = opt(
        0, "LoRA rank (PEFT adapters on the trained models; the base weights stay frozen). 0: train every weight."
    )
    lora_alpha: int = opt(16, "LoRA alpha: the adapter's update is scaled by alpha / rank.")
    target_modules: tuple[str, ...] = opt(
        ("all-linear",),
        "Modules that get LoRA adapters: module names (q_proj "
        "v_proj ...) or all-linear (every linear layer but the "
        "output head), as PEFT's target_modules.",
    )
    lora_dropout: float = opt(0.0, "Dropout on the LoRA adapters' input during training.")


# --model_preset of the tiny vision-language policy (rlrun.vision.demo builds and saves it).
VL_PRESET = "tiny-vl"


@dataclass
class ModelConfig(PretrainedConfig):
    """Models and reward sources."""

    freeze_visual_encoder: bool = opt(
        False,
        "Vision-language policies: train the language model only; the vision "
        "tower and its projector keep their weights (no gradients, no optimizer "
        "state).",
    )
    freeze_prefix: tuple[str, ...] | None = opt(
        None,
        "Keep the actor's parameters whose names start with these fixed "
        "(OpenRLHF-M's --freeze_prefix visual); checkpoint names and "
        "the model's own both match.",
    )
    reward_pretrain: str | None = opt(
        None, "Reward model directory (sequence-classification or value-head model scoring the last token)."
    )
    critic_pretrain: str | None = opt(None, "Critic initialisation. Unset: the reward model, else the policy.")
    teacher_pretrain: str | None = opt(
        None,
        "On-policy distillation: a frozen teacher (HF directory or hub id, the policy's tokenizer) scores the "
        "policy's own samples and the per-token reverse KL to it trains the policy (--teacher_kl_*); laid out like "
        "the reference (--teacher_num_nodes/--teacher_num_gpus_per_node, --colocate_actor_teacher).",
    )
    remote_rm_url: str | None = opt(
        None,
        "Reward from a local Python file defining reward_func(queries, prompts, "
        "labels), or an http(s):// endpoint; 'demo' is the demo's rule. With no "
        "reward source at all only the demo runs (built-in prompts, embedded "
        "model); anything else must name one.",
    )
    remote_rm_timeout: float = opt(
        30.0, "Seconds to wait for each HTTP reward request (--remote_rm_url http(s)://...)."
    )
    remote_rm_retries: int = opt(
        3, "Attempts per HTTP reward batch (connection errors, timeouts and 5xx are retried with backoff)."
    )
    compute_score: str | None = opt(
        None,
        "verl's reward convention: a .py file defining compute_score(data_source, "
        "solution_str, ground_truth, extra_info) called per sample (a float, or a "
        "dict whose 'score' is the reward), or 'builtin' for rlrun's versions of "
        "verl's rule scores (GSM8K, MATH, DAPO/AIME, NuminaMath, Geometry3K, Search-R1 QA), chosen per prompt by its "
        "data source. The label is --label_key (verl: reward_model.ground_truth).",
    )
    compute_score_name: str = opt(
        "compute_score", "The function --compute_score calls in its file (verl's custom_reward_function.name)."
    )
    reward_workers: int | None = opt(
        None,
        "Processes scoring samples with --compute_score in parallel (1: in this "
        "process). Unset: min(8, CPU cores / processes on the node).",
    )
    reward_timeout: float | None = opt(
        None,
        "Seconds one call of a reward file's reward_func may take on one batch; "
        "past it the run fails naming the function and the batch. Unset: 0.8 x "
        "--dist_timeout (the other ranks wait that long at most).",
    )

    @property
    def needs_reward_model(self) -> bool:
        return self.reward_pretrain is not None and self.remote_rm_url is None
