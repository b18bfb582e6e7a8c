"""The model section (every trainer): the model being trained, where it comes from and how it runs (precision,
attention, LoRA). The RL step's other models are their owners' sections (critic, distill, reward)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlrun.config.fields import opt
from rlrun.runtime.errors import ConfigError


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

    def check(self) -> None:
        """Precision, attention and LoRA settings (caught here rather than by PEFT mid-build, or, for all-linear beside
        module names, which PEFT reads as one more name, never)."""
        if self.flash_attn and not self.bf16:
            raise ConfigError(
                "--flash_attn needs --bf16: flash-attention 2 runs only in half precision (its kernel "
                "refuses fp32 inputs); add --bf16, or drop --flash_attn for PyTorch's SDPA"
            )
        rank = self.lora_rank
        if rank < 0:
            raise ConfigError(f"--lora_rank must be >= 0 (0: train every weight; LoRA: e.g. 8, 16 or 64), got {rank}")
        if rank > 0 and self.lora_alpha <= 0:
            raise ConfigError(
                f"--lora_alpha must be > 0 with --lora_rank {rank} (the adapters' update is scaled by alpha "
                f"/ rank; OpenRLHF's and verl's default is 16), got {self.lora_alpha}"
            )
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(
                f"--lora_dropout must be in [0, 1) (the chance of zeroing an adapter input), got {self.lora_dropout}"
            )
        targets = list(self.target_modules)
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


# --model_preset of the tiny vision-language policy (rlrun.vision.demo builds and saves it).
VL_PRESET = "tiny-vl"
