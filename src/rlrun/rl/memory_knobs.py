"""What the memory estimate (rlrun.rl.memory_estimate) reads besides the models' shapes: the target (GPUs or the CPU),
the settings that move the bytes (Knobs, from a PPO config or a supervised trainer's), and what a supervised trainer's
ranks hold (SupervisedJob). Knobs are effective values (bf16 and offload are GPU-only), so that advice can change one
with dataclasses.replace and estimate again."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rlrun.config.schema import Config
from rlrun.launch.layout import Layout, Role

GIB = 1 << 30
MIB = 1 << 20
GPU_USABLE_FRACTION = 0.95  # the rest: CUDA context (~0.5 GiB) and allocator fragmentation


@dataclass(frozen=True)
class Target:
    """What the ranks run on: GPUs of `gpu_bytes` each, or the CPU (gpu_bytes 0)."""

    gpu: bool
    gpu_bytes: int
    source: str  # how gpu_bytes was found, for the printed plan

    @property
    def usable(self) -> int:
        return int(self.gpu_bytes * GPU_USABLE_FRACTION)


@dataclass(frozen=True)
class Knobs:
    """The settings the estimate reads (effective values: bf16 and offload are GPU-only), so that advice can
    change one with dataclasses.replace and estimate again."""

    gpu: bool
    bf16: bool
    strategy: str
    zero_stage: int
    adam_offload: bool
    checkpointing: bool
    attention_scores: bool
    micro_train: int
    micro_rollout: int
    seq: int
    response: int
    logits_chunk: int
    model_sleep: bool
    engine_sleep: bool
    backend: str
    vllm_util: float
    vllm_kv_bytes: int | None
    rollouts: int  # rows the engines generate at once: a step's rollouts (--partial_rollout: --max_staleness steps')
    kv_budget: int | None
    export_critic: bool = False  # --save_value_network
    sync_bucket: int = 256 * MIB  # --weight_sync_bucket_mb
    export_merged: bool = False  # --save_merged (with --lora_rank: the export gathers the whole model to merge it)
    engine_tp: int | None = None  # ranks per engine instead of the layout's (advice only)
    vllm_host: str = "auto"  # --vllm_engine_host: a colocated child keeps a policy copy, an in-process engine none
    ref_offload: bool | None = None  # rlrun.dpo's --ref_offload (None: the trainer has no such flag)
    ref_in_train: bool = False  # rlrun.dpo: the reference scores inside the policy's training step
    lora_rank: int = 0  # --lora_rank (0: every weight is trained)
    lora_targets: tuple[str, ...] = ("all-linear",)  # --target_modules
    base_reference: bool = False  # the reference is the trained model with its adapters off (no reference model)


@dataclass(frozen=True)
class SupervisedJob:
    """What every rank of rlrun.sft / rlrun.rm / rlrun.dpo holds: the trained model as PPO's actor, or with `scalar`
    its critic (a score head: rlrun.rm); with `reference` a frozen reference (rlrun.dpo), which with
    `base_reference` (LoRA) is the trained model with its adapters off instead of a model of its own; `pairs`: a
    sample is two rows (chosen and rejected)."""

    pairs: bool = False
    scalar: bool = False
    reference: bool = False
    base_reference: bool = False

    def for_config(self, cfg: Any) -> SupervisedJob:
        """This job as `cfg` runs it: rlrun.dpo with --lora_rank scores its reference on the policy's base (adapters
        off), unless --ref_pretrain names another model, which stays a frozen model of its own."""
        m = cfg.model
        other = getattr(getattr(cfg, "loss", None), "ref_pretrain", None) not in (None, m.pretrain)
        return dataclasses.replace(self, base_reference=self.reference and m.lora_rank > 0 and not other)

    @property
    def trained(self) -> Role:
        return Role.CRITIC if self.scalar else Role.ACTOR

    def layout(self, world_size: int, ranks_per_node: int) -> Layout:
        everyone = tuple(range(world_size))
        separate = self.reference and not self.base_reference
        roles = {self.trained: everyone, **({Role.REF: everyone} if separate else {})}
        return Layout(world_size, ranks_per_node, roles, (), ())

    def labels(self) -> dict[str, str]:
        """How the printed plan names the roles and phases."""
        return {self.trained.value: "policy" if self.reference else "model", f"train_{self.trained.value}": "train",
                "score": "eval"}


def native_kv_budget(cfg: Config) -> int | None:
    """--native_kv_cache_mb in bytes (None: unset; read with getattr while the flag is new)."""
    mib = getattr(cfg.generation, "native_kv_cache_mb", None)
    return int(mib * MIB) if mib else None


def _training_knobs(cfg: Any, target: Target) -> dict[str, Any]:
    """The settings every trainer shares (its model and optimisation sections)."""
    t, m = cfg.train, cfg.model
    return dict(gpu=target.gpu, bf16=m.bf16 and target.gpu, strategy=t.strategy, zero_stage=t.zero_stage,
                adam_offload=t.adam_offload and target.gpu, checkpointing=m.gradient_checkpointing,
                attention_scores=m.attn_implementation == "eager" and not m.flash_attn,
                logits_chunk=int(getattr(t, "logits_chunk_size", 1024)), lora_rank=max(0, m.lora_rank),
                lora_targets=tuple(m.target_modules), export_merged=cfg.checkpoint.save_merged)


def knobs_of(cfg: Config, target: Target) -> Knobs:
    """`cfg`'s generation_backend must be the resolved one (rlrun.engines.choice), not auto."""
    t, g = cfg.train, cfg.generation
    return Knobs(
        **_training_knobs(cfg, target), micro_train=t.micro_train_batch_size, micro_rollout=t.micro_rollout_batch_size,
        seq=g.prompt_max_len + g.generate_max_len, response=g.generate_max_len,
        model_sleep=t.deepspeed_enable_sleep and target.gpu, engine_sleep=g.vllm_enable_sleep and target.gpu,
        backend=g.generation_backend, vllm_util=g.vllm_gpu_memory_utilization,
        vllm_kv_bytes=g.vllm_kv_cache_memory_bytes,
        rollouts=cfg.rollouts_per_step * (t.max_staleness if t.partial_rollout else 1), kv_budget=native_kv_budget(cfg),
        export_critic=cfg.checkpoint.save_value_network, base_reference=cfg.ref_is_actor_base,
        sync_bucket=g.weight_sync_bucket_mb * MIB, vllm_host=g.vllm_engine_host)


def supervised_knobs(cfg: Any, target: Target, job: SupervisedJob) -> Knobs:
    """The settings of a supervised trainer's config (rlrun.supervised.config)."""
    rows = cfg.train.micro_train_batch_size * (2 if job.pairs else 1)
    return Knobs(**_training_knobs(cfg, target), micro_train=rows, micro_rollout=rows, seq=cfg.train.max_len,
                 response=cfg.train.max_len, model_sleep=False, engine_sleep=False, backend="none", vllm_util=0.0,
                 vllm_kv_bytes=None, rollouts=0, kv_budget=None, export_critic=job.scalar,
                 ref_offload=cfg.loss.ref_offload and target.gpu if job.reference and not job.base_reference else None,
                 ref_in_train=job.reference, base_reference=job.base_reference)
