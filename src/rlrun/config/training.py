"""The training sections: optimisation and batch sizes every trainer reads (`OptimConfig`), and rlrun.ppo's rollout
batches, schedule and learning rates (`TrainConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlrun.config.fields import non_negative, opt, positive
from rlrun.runtime.errors import ConfigError


@dataclass
class OptimConfig:
    """Batch sizes, schedule, optimisation (every trainer)."""

    train_batch_size: int = opt(
        128,
        "Samples per optimizer step over all training ranks (PPO: sequences; rlrun.rm/rlrun.dpo: preference pairs).",
    )
    micro_train_batch_size: int = opt(4, "Samples per forward/backward, per rank.")
    max_epochs: int = opt(1, "PPO: passes over each rollout batch; rlrun.sft/rm/dpo: passes over the dataset.")
    packing_samples: bool = opt(
        False,
        "Score and train on packed rows: the real tokens of several sequences share a "
        "row (per-sequence position ids) instead of padded rows. Text models on sdpa pack a "
        "micro-batch into one row and attend each sequence by itself (flash-attention: its "
        "varlen kernel; eager and vision-language models: a block-diagonal mask). rlrun.ppo: "
        "on by default with a CUDA device (--packing_samples false turns it off); off on CPU "
        "and for rlrun.sft/rm/dpo unless given.",
    )
    sequence_parallel_size: int = opt(
        1,
        "Ulysses sequence parallelism: groups of N consecutive ranks of each trained and scoring role "
        "(rlrun.sft/rm/dpo: of all ranks) share every micro-batch's tokens (all-to-all of attention heads), so a "
        "response N times as long fits; the role's ranks must divide by N. Needs packed rows (turned on with it). "
        "OpenRLHF's --ring_attn_size and verl's ulysses_sequence_parallel_size set it.",
    )
    max_samples: int = opt(100_000_000, "Use at most this many records of the dataset (the first ones).")
    max_steps: int | None = opt(
        None, "Stop after this many steps (PPO: rollout + update; rlrun.sft/rm/dpo: optimizer steps)."
    )
    lr_warmup_ratio: float = opt(0.03, "Fraction of optimizer steps spent in linear warmup (then cosine decay).")
    adam_betas: tuple[float, float] = opt((0.9, 0.95), "Adam betas.")
    max_norm: float = opt(1.0, "Gradient clipping norm.")
    max_skipped_steps: int = opt(
        10,
        "Fail when this many optimizer steps in a row are skipped for a NaN/inf gradient "
        "(each one is skipped and counted).",
    )
    l2: float = opt(0.0, "Weight decay.")
    zero_stage: int = opt(
        2, "Sharding stage: 3 reshards parameters after forward (ZeRO-3-like); 0-2 keep them gathered until backward."
    )
    adam_offload: bool = opt(
        False,
        "Offload to CPU (GPU only): with fsdp parameters, gradients and optimizer state; "
        "with deepspeed the optimizer state and fp32 master weights (ZeRO-Offload, "
        "DeepSpeedCPUAdam).",
    )
    strategy: Literal["fsdp", "deepspeed"] = opt(
        "fsdp",
        "How the trained and frozen models are sharded and stepped on their ranks: fsdp "
        "(FSDP2, --zero_stage 0-3) or deepspeed (DeepSpeed ZeRO, --zero_stage 0-2 on any role group, 3 when every "
        "model spans all ranks; pip install 'rlrun[deepspeed]').",
    )
    seed: int = opt(42, "Seed for data order, initialisation and sampling.")

    @property
    def reduces_on_cpu(self) -> bool:
        """FSDP2 with --adam_offload keeps gradients on the CPU, so the gradient norm is reduced over CPU tensors."""
        return self.adam_offload and self.strategy == "fsdp"

    def check(self) -> None:
        for name in ("train_batch_size", "micro_train_batch_size", "max_epochs", "max_samples", "max_skipped_steps"):
            positive(name, getattr(self, name))
        positive("max_steps", self.max_steps, allow_none=True)
        positive("sequence_parallel_size", self.sequence_parallel_size)
        if not 0 <= self.lr_warmup_ratio <= 1:
            raise ConfigError(f"--lr_warmup_ratio must be in [0, 1], got {self.lr_warmup_ratio}")
        if self.max_norm < 0 or self.l2 < 0:
            raise ConfigError(f"--max_norm and --l2 must be >= 0, got {self.max_norm} and {self.l2}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"--zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")


@dataclass
class TrainConfig(OptimConfig):
    """Rollout batches, the schedule of PPO-style training, learning rates."""

    rollout_batch_size: int = opt(1024, "Prompts per step (before n_samples_per_prompt).")
    micro_rollout_batch_size: int = opt(8, "Sequences per forward pass when scoring rollouts, per rank.")
    logits_chunk_size: int = opt(
        1024,
        "rlrun: positions per chunk of the vocabulary projection when computing "
        "log-probs/entropy (actor and reference); bounds the logits' memory to chunk x vocab "
        "x "
        "4 bytes; 0 = whole sequences (more memory, same numbers). Models whose forward "
        "transforms the logits (Gemma-2/3 soft-capping, Cohere, Granite) always use 0.",
    )
    dynamic_batch: bool = opt(
        False,
        "Form micro-batches by tokens instead of --micro_train_batch_size / "
        "--micro_rollout_batch_size (OpenRLHF's --use_dynamic_batch, verl's use_dynamic_bsz): "
        "rows are dealt to each role's ranks balanced by length, then sorted by length into "
        "micro-batches of at most --train_max_tokens_per_gpu tokens (scoring: "
        "--rollout_max_tokens_per_gpu), each cut to its own longest row, the same number on "
        "every rank of a role. Long-tailed response lengths then train on far less padding; "
        "the loss normalisation (whole mini-batch token/sequence mean) is unchanged. On by default "
        "with a CUDA device, budgets unless given the memory plan's micro-batches "
        "(--micro_train_batch_size / --micro_rollout_batch_size rows of the longest row); off on CPU.",
    )
    train_max_tokens_per_gpu: int = opt(
        16192,
        "--dynamic_batch: the most tokens of one training micro-batch on one "
        "rank: "
        "rows x (longest prompt + longest response) of its rows, or with "
        "--packing_samples their packed (real) tokens. At least --prompt_max_len + "
        "--generate_max_len (OpenRLHF's default 16192; verl: "
        "ppo_max_token_len_per_gpu).",
    )
    rollout_max_tokens_per_gpu: int | None = opt(
        None,
        "--dynamic_batch: the same budget for the scoring forwards "
        "(old/ref "
        "log-probs, values, reward-model scores; no gradients, so it may be "
        "larger). Unset: --train_max_tokens_per_gpu, as OpenRLHF.",
    )
    n_samples_per_prompt: int = opt(1, "Responses sampled per prompt.")
    async_train: bool = opt(
        False,
        "Overlap generation with training (engines on ranks of their own): the engines "
        "generate step N+1 "
        "with the weights before step N's update while the other ranks train on step N, i.e. one "
        "step "
        "off-policy, always exactly one (deterministic and exactly resumable). Default: on-policy.",
    )
    partial_rollout: bool = opt(
        False,
        "With --async_train: engines keep sequences in flight (--max_staleness steps' "
        "worth) "
        "and go on with them while the learners train; a step takes the first whole groups to "
        "finish, and the unfinished ones carry across the weight sync and continue under the "
        "new "
        "weights (tokens of one response may come from several policy versions; the PPO ratio "
        "uses the actor's recomputed log-probs, the engine's per-token ones feed "
        "--is_correction_level). Long-tailed response lengths then stop stalling every step "
        "on its "
        "longest sample. Not bit-reproducible (how far the engines get while the learners "
        "train "
        "depends on timing).",
    )
    partial_rollout_tokens: int = opt(
        32,
        "--partial_rollout: new tokens a sequence generates between two points where "
        "the engine may hand finished groups over and take new weights.",
    )
    max_staleness: int = opt(
        2,
        "--partial_rollout: the most policy versions a trained token may lag the policy "
        "trained "
        "on it; groups holding older tokens are restarted from their prompt. An engine holds this "
        "many steps' rows (generating or finished). 1: no response outlives a weight sync, which "
        "is --async_train's loop exactly.",
    )
    async_queue_size: int = opt(
        1,
        "Rollout batches in flight with --async_train; rlrun always keeps exactly 1 "
        "(OpenRLHF's default); other values are reported and ignored (--partial_rollout "
        "bounds its samples' age with --max_staleness).",
    )
    num_episodes: int = opt(1, "Passes over the prompt dataset.")
    actor_learning_rate: float = opt(1e-6, "Actor learning rate.")
    sleep: bool = opt(
        False,
        "With either --strategy (OpenRLHF's --deepspeed_enable_sleep is the same flag): each role's parameters and "
        "its gradients/optimizer state move to CPU memory between the phases that use them and back (bit-identical "
        "results), so colocated roles and engines fit one GPU; what --adam_offload already keeps on the CPU stays "
        "there. Not with --strategy deepspeed --zero_stage 3.",
    )

    @property
    def rollouts_per_step(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def continues_rollouts(self) -> bool:
        """--partial_rollout in effect: responses outlive a weight sync (--max_staleness 1 lets none: that is
        --async_train's loop, run as such)."""
        return self.partial_rollout and self.max_staleness > 1

    def check(self) -> None:
        super().check()
        for name in ("rollout_batch_size", "micro_rollout_batch_size", "n_samples_per_prompt", "num_episodes"):
            positive(name, getattr(self, name))
        non_negative("actor_learning_rate", self.actor_learning_rate)
        positive("train_max_tokens_per_gpu", self.train_max_tokens_per_gpu)
        positive("rollout_max_tokens_per_gpu", self.rollout_max_tokens_per_gpu, allow_none=True)
        if self.sleep and self.strategy == "deepspeed" and self.zero_stage == 3:
            raise ConfigError(
                "--sleep (OpenRLHF's --deepspeed_enable_sleep) with --strategy deepspeed --zero_stage 3 is not "
                "supported (rlrun's DeepSpeed strategy runs ZeRO-0/1/2; DeepSpeed's own ZeRO-3 offload_states needs "
                "FusedAdam on CUDA); use --zero_stage 1 or 2, or --strategy fsdp --zero_stage 3"
            )
        if self.partial_rollout:
            positive("partial_rollout_tokens", self.partial_rollout_tokens)
            positive("max_staleness", self.max_staleness)
            if not self.async_train:
                raise ConfigError(
                    "--partial_rollout needs --async_train (as OpenRLHF's --train.partial_rollout_enable needs "
                    "--train.async_enable): unfinished responses carry over while the learners train"
                )
