"""What the memory plan (rlrun.plan.memory) needs of each model, read from its HF config.json alone (no
weights): hidden size, layers, heads, KV heads, head size, vocabulary and the parameter counts by part (embedding,
all blocks, the largest block, final norm, head), and each role's shape (critic and reward models: the body with a
[hidden, 1] score head).

Parameter counts are exact for Llama, Qwen2, Qwen3, Mistral and their MoE kin (Mixtral, Qwen2-MoE, Qwen3-MoE);
other decoders are read through the same config fields (approximate); vision towers are not counted.

LoRA (--lora_rank): `lora_parameters` counts PEFT's adapters from the same shape: each targeted nn.Linear
[out, in] gets A [r, in] and B [out, r] (bias="none"), r * (in + out) parameters. The linear layers are the
body's projections (`ModelShape.linears`: q/k/v/o_proj, gate/up/down_proj, a Qwen2-MoE shared expert and its
gate), which is what PEFT's all-linear takes (every nn.Linear but the output head); the routed experts of MoE layers
are fused tensors whose adapters depend on the PEFT and transformers versions, so they are not counted
(`ModelShape.moe_layers` says how many such layers were left out).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rlrun.config.tree import Config
from rlrun.engines.build import runs_adapters
from rlrun.launch.layout import Layout, Role
from rlrun.models.architecture import tied_embeddings
from rlrun.models.moe import is_sparse_layer
from rlrun.plan.sequence_parallel import sequence_parallel_sizes
from rlrun.runtime.errors import ConfigError


@dataclass(frozen=True)
class Linear:
    """`count` nn.Linear layers of the same kind across the model, `fan_in` -> `fan_out` features. `path` is the
    module's name below its decoder layer (self_attn.q_proj, mlp.shared_expert.down_proj): PEFT matches a target
    name against the end of a module's dotted name, so both q_proj and self_attn.q_proj name it."""

    path: str
    fan_in: int
    fan_out: int
    count: int

    def matches(self, target: str) -> bool:
        return self.path == target or self.path.endswith("." + target)


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of one model; parameter counts exact for Llama/Qwen2/Qwen3/Mistral (and their MoE)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    embedding: int  # token embedding parameters
    blocks: int  # all transformer blocks
    largest_block: int
    final_norm: int
    head: int  # LM head (0 when tied to the embedding), or the [hidden, 1] score head of a critic/reward model
    linears: tuple[Linear, ...] = ()  # the body's linear layers (what PEFT's all-linear adapts)
    moe_layers: int = 0  # layers with routed experts, whose adapters lora_parameters does not count
    vision: int = 0  # a vision-language model's image encoder and projector
    mlp_widths: tuple[int, ...] = ()  # per layer, the MLP's inner width one token goes through (the activations')

    @property
    def parameters(self) -> int:
        return self.embedding + self.blocks + self.final_norm + self.head + self.vision

    @property
    def root(self) -> int:
        """FSDP's root unit, gathered for a whole forward and backward: the final norm, and the embedding and head
        when they are tied (an untied embedding and head are units of their own, rlrun.strategies.fsdp.vocab_units)."""
        return self.final_norm + (self.embedding if not self.head else 0)

    @property
    def largest_unit(self) -> int:
        """The largest FSDP unit gathered one at a time: a block, or the untied embedding or head."""
        return max(self.largest_block, self.embedding if self.head else 0, self.head)

    def scalar(self) -> ModelShape:
        """The same body with a [hidden, 1] score head instead of the LM head (AutoModelForSequenceClassification)."""
        return dataclasses.replace(self, head=self.hidden)


def _need(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(
            f"config.json has no positive {name} (got {value!r}, model_type "
            f"{getattr(config, 'model_type', None)!r}): the memory plan reads the architecture from it"
        )
    return value


def _attention_biases(config: Any, kind: str) -> tuple[bool, bool]:
    """(q/k/v biases, o bias): Qwen2-family models hard-code q/k/v biases (Qwen2-MoE: qkv_bias); Llama-style
    configs put one attention_bias on all four."""
    if kind.startswith("qwen2"):
        return bool(getattr(config, "qkv_bias", True)), False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


def _mlp(config: Any, layer: int, hidden: int) -> int:
    """Parameters of one layer's MLP: dense SwiGLU, or routed experts + router (+ Qwen2-MoE's gated shared expert)."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not is_sparse_layer(config, layer):
        inner = _need(config, "intermediate_size")
        return 3 * hidden * inner + (2 * inner + hidden if getattr(config, "mlp_bias", False) else 0)
    inner = getattr(config, "moe_intermediate_size", None) or _need(config, "intermediate_size")
    assert experts is not None  # _is_sparse: the config has experts
    total = experts * 3 * hidden * inner + experts * hidden
    shared = getattr(config, "shared_expert_intermediate_size", None)
    return total + (3 * hidden * shared + hidden if shared else 0)


def _mlp_width(config: Any, layer: int) -> int:
    """The inner width of the MLP one token of `layer` goes through: the dense SwiGLU's, or its top-k experts' plus
    a shared expert's (what its activations scale with)."""
    if not is_sparse_layer(config, layer):
        return _need(config, "intermediate_size")
    inner = getattr(config, "moe_intermediate_size", None) or _need(config, "intermediate_size")
    top_k = getattr(config, "num_experts_per_tok", None) or 1
    return top_k * inner + (getattr(config, "shared_expert_intermediate_size", None) or 0)


def _linears(config: Any, hidden: int, q: int, kv: int, layers: int) -> tuple[Linear, ...]:
    """The body's nn.Linear layers by kind, summed over layers: attention's four projections in every layer, the
    dense SwiGLU's three in dense layers, a Qwen2-MoE shared expert's three and its [hidden, 1] gate in sparse ones
    (routed experts are fused tensors, not nn.Linear, in current transformers; routers vary by model)."""
    sparse = sum(is_sparse_layer(config, i) for i in range(layers))
    dense = layers - sparse
    out = [
        Linear("self_attn.q_proj", hidden, q, layers),
        Linear("self_attn.k_proj", hidden, kv, layers),
        Linear("self_attn.v_proj", hidden, kv, layers),
        Linear("self_attn.o_proj", q, hidden, layers),
    ]
    if dense:
        inner = _need(config, "intermediate_size")
        out += [
            Linear("mlp.gate_proj", hidden, inner, dense),
            Linear("mlp.up_proj", hidden, inner, dense),
            Linear("mlp.down_proj", inner, hidden, dense),
        ]
    shared = getattr(config, "shared_expert_intermediate_size", None)
    if sparse and shared:
        out += [
            Linear("mlp.shared_expert.gate_proj", hidden, shared, sparse),
            Linear("mlp.shared_expert.up_proj", hidden, shared, sparse),
            Linear("mlp.shared_expert.down_proj", shared, hidden, sparse),
            Linear("mlp.shared_expert_gate", hidden, 1, sparse),
        ]
    return tuple(out)


def vision_tower_parameters(config: Any) -> int:
    """Parameters of a Qwen2-VL / Qwen2.5-VL-style vision tower from its `vision_config` (0 without one): the patch
    embedding (a bias-free Conv3d), per block two norms, fused qkv and output projections with biases and the MLP
    (SwiGLU with `intermediate_size`, or Qwen2-VL's fc1/fc2 of embed_dim x mlp_ratio), and the patch merger
    (a norm, then two linears from hidden x merge^2 to the language model's width)."""
    v = getattr(config, "vision_config", None)
    if v is None:
        return 0
    hidden = getattr(v, "embed_dim", None) or _need(v, "hidden_size")
    depth, patch = _need(v, "depth"), _need(v, "patch_size")
    channels = getattr(v, "in_channels", None) or getattr(v, "in_chans", 3)
    temporal, merge = getattr(v, "temporal_patch_size", 2), getattr(v, "spatial_merge_size", 2)
    out = getattr(v, "out_hidden_size", None) or getattr(v, "hidden_size", None) or hidden
    gated = getattr(v, "intermediate_size", None) is not None and getattr(v, "embed_dim", None) is None
    inner = v.intermediate_size if gated else int(hidden * getattr(v, "mlp_ratio", 4))
    mlp = 3 * hidden * inner + 2 * inner + hidden if gated else 2 * hidden * inner + inner + hidden
    norms = 2 * hidden * (1 if gated else 2)  # RMSNorm (Qwen2.5-VL) or LayerNorm with bias (Qwen2-VL)
    block = norms + 3 * hidden * hidden + 3 * hidden + hidden * hidden + hidden + mlp
    wide = hidden * merge**2
    merger = hidden * (1 if gated else 2) + wide * wide + wide + wide * out + out
    return channels * temporal * patch * patch * hidden + depth * block + merger  # type: ignore[operator]  # mypy keeps getattr's None in `channels`


def model_shape(config: Any) -> ModelShape:
    """The shape of a causal LM from its HF config (a multimodal config's text model, and its vision tower's
    parameter count)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, layers, heads = _need(c, "hidden_size"), _need(c, "num_hidden_layers"), _need(c, "num_attention_heads")
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    vocab = _need(c, "vocab_size")
    kind = str(getattr(c, "model_type", ""))
    qkv_bias, o_bias = _attention_biases(c, kind)
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden + (q + 2 * kv if qkv_bias else 0) + (hidden if o_bias else 0)
    attention += 2 * head_dim if kind.startswith("qwen3") else 0  # q_norm, k_norm
    sizes = [attention + 2 * hidden + _mlp(c, i, hidden) for i in range(layers)]  # + the two RMSNorms
    head = 0 if tied_embeddings(config) else vocab * hidden
    return ModelShape(
        hidden,
        layers,
        heads,
        kv_heads,
        head_dim,
        vocab,
        vocab * hidden,
        sum(sizes),
        max(sizes),
        hidden,
        head,
        _linears(c, hidden, q, kv, layers),
        sum(is_sparse_layer(c, i) for i in range(layers)),
        vision_tower_parameters(config),
        tuple(_mlp_width(c, i) for i in range(layers)),
    )


ALL_LINEAR = "all-linear"


def _all_linear(targets: tuple[str, ...]) -> bool:
    return any(t.lower() == ALL_LINEAR for t in targets)  # PEFT compares case-insensitively


def unknown_targets(shape: ModelShape, targets: tuple[str, ...]) -> tuple[str, ...]:
    """The --target_modules names that match none of the body's linear layers (PEFT would refuse them, or they
    name modules the plan does not model: lm_head, embed_tokens): counted as no adapters, and said in a note."""
    if _all_linear(targets):
        return ()
    return tuple(t for t in targets if not any(linear.matches(t) for linear in shape.linears))


def lora_parameters(shape: ModelShape, rank: int, targets: tuple[str, ...]) -> int:
    """PEFT's LoRA parameters on `targets` (all-linear, or module names matched against the end of the module's
    name): r * (in + out) per adapted nn.Linear (A [r, in], B [out, r]; no bias: PEFT's bias="none")."""
    if rank <= 0:
        return 0
    chosen = (
        shape.linears
        if _all_linear(targets)
        else [linear for linear in shape.linears if any(linear.matches(t) for t in targets)]
    )
    return sum(rank * (linear.fan_in + linear.fan_out) * linear.count for linear in chosen)


def role_shapes(
    policy: ModelShape,
    critic: ModelShape | None = None,
    reward: ModelShape | None = None,
    ref: ModelShape | None = None,
    teacher: ModelShape | None = None,
) -> dict[Role, ModelShape]:
    """Each role's shape: the policy's for actor/engines, and for the reference unless it has its own (rlrun.dpo's
    --ref_pretrain); the distillation teacher's own (--teacher_pretrain); a score-head body for critic/reward (their
    own config when given, else the policy's body)."""
    return {
        Role.ACTOR: policy,
        Role.REF: ref or policy,
        Role.TEACHER: teacher or policy,
        Role.ENGINE: policy,
        Role.CRITIC: (critic or policy).scalar(),
        Role.REWARD: (reward or policy).scalar(),
    }


# ---- knobs -------------------------------------------------------------------------------------------------------
# What the memory estimate (rlrun.plan.memory) reads besides the models' shapes: the target (GPUs or the CPU),
# the settings that move the bytes (Knobs, from a PPO config or a supervised trainer's), and what a supervised trainer's
# ranks hold (SupervisedJob). Knobs are effective values (bf16 and offload are GPU-only), so that advice can change one
# with dataclasses.replace and estimate again.

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
    engine_restarts: bool = False  # --max_engine_restarts > 0: a child host at TP 1 keeps a host copy of each sync
    ref_offload: bool | None = None  # rlrun.dpo's --ref_offload (None: the trainer has no such flag)
    ref_in_train: bool = False  # rlrun.dpo: the reference scores inside the policy's training step
    lora_rank: int = 0  # --lora_rank (0: every weight is trained)
    lora_targets: tuple[str, ...] = ("all-linear",)  # --target_modules
    base_reference: bool = False  # the reference is the trained model with its adapters off (no reference model)
    sequence_parallel: tuple[tuple[Role, int], ...] = ()  # roles with --sequence_parallel_size > 1 and their sizes
    gateway_calls: int = 0  # model calls an episode through the token gateway may make (0: no such source)
    many_senders: bool = False  # --weight_sync_senders all, no LoRA: every actor rank sends its shard to the engines
    sync_delta: bool = False  # --weight_sync_delta: each actor rank keeps its shard's last sync
    adapter_sync: bool = False  # LoRA on native or vLLM engines: each sync sends the adapters alone (engines.build)

    def sp_of(self, role: Role) -> int:
        return dict(self.sequence_parallel).get(role, 1)


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
        return {
            self.trained.value: "policy" if self.reference else "model",
            f"train_{self.trained.value}": "train",
            "score": "eval",
        }


def native_kv_budget(cfg: Config) -> int | None:
    """--native_kv_cache_mb in bytes (None: unset; read with getattr while the flag is new)."""
    mib = getattr(cfg.generation, "native_kv_cache_mb", None)
    return int(mib * MIB) if mib else None


def _training_knobs(cfg: Any, target: Target) -> dict[str, Any]:
    """The settings every trainer shares (its model and optimisation sections)."""
    t, m = cfg.train, cfg.model
    return dict(
        gpu=target.gpu,
        bf16=m.bf16 and target.gpu,
        strategy=t.strategy,
        zero_stage=t.zero_stage,
        adam_offload=t.adam_offload and target.gpu,
        checkpointing=m.gradient_checkpointing,
        attention_scores=m.attn_implementation == "eager" and not m.flash_attn,
        logits_chunk=int(getattr(t, "logits_chunk_size", 1024)),
        lora_rank=max(0, m.lora_rank),
        lora_targets=tuple(m.target_modules),
        export_merged=cfg.checkpoint.save_merged,
    )


def budget_rows(rows: int, budget: int | None, seq: int) -> int:
    """The rows of `seq` tokens a micro-batch's activations are planned for: `rows` (the fixed micro-batch), or with
    --dynamic_batch its token `budget` in whole longest rows, rounded up (a micro-batch holds at most `budget`
    tokens, in rows of any length; the speed defaults' budget is `rows` x `seq`, the same plan)."""
    return rows if budget is None else max(1, -(-budget // seq))


def knobs_of(cfg: Config, target: Target) -> Knobs:
    """`cfg`'s generation_backend must be the resolved one (rlrun.plan.plan), not auto."""
    t, g = cfg.train, cfg.generation
    seq = g.prompt_max_len + g.generate_max_len
    scoring = t.rollout_max_tokens_per_gpu or t.train_max_tokens_per_gpu
    return Knobs(
        **_training_knobs(cfg, target),
        micro_train=budget_rows(t.micro_train_batch_size, t.train_max_tokens_per_gpu if t.dynamic_batch else None, seq),
        micro_rollout=budget_rows(t.micro_rollout_batch_size, scoring if t.dynamic_batch else None, seq),
        seq=seq,
        response=g.generate_max_len,
        model_sleep=t.sleep and target.gpu,
        engine_sleep=g.vllm_enable_sleep and target.gpu,
        backend=g.generation_backend,
        vllm_util=g.vllm_gpu_memory_utilization,
        vllm_kv_bytes=g.vllm_kv_cache_memory_bytes,
        rollouts=cfg.train.rollouts_per_step * (t.max_staleness if t.partial_rollout else 1),
        kv_budget=native_kv_budget(cfg),
        export_critic=cfg.critic.save_value_network,
        base_reference=cfg.ref_is_actor_base,
        sync_bucket=g.weight_sync_bucket_mb * MIB,
        vllm_host=g.vllm_engine_host,
        engine_restarts=g.max_engine_restarts > 0,
        sequence_parallel=tuple((role, sp) for role, sp in sequence_parallel_sizes(cfg).items() if sp > 1),
        gateway_calls=gateway_calls(cfg),
        many_senders=g.weight_sync_senders == "all" and cfg.model.lora_rank == 0,
        sync_delta=g.weight_sync_delta,
        # the model's density and vision tower are the shape's (sync_staging_bytes)
        adapter_sync=cfg.model.lora_rank > 0
        and runs_adapters(
            g.generation_backend, cfg.model.target_modules, True, cfg.resources.vllm_tensor_parallel_size, False
        ),
    )


def gateway_calls(cfg: Config) -> int:
    """The model calls one gateway episode may make: --max_turns, else as many calls of --max_tokens_per_turn as
    --generate_max_len holds (one without it); 0 without a gateway source."""
    a, g = cfg.agent, cfg.generation
    if a.gateway_source is None:
        return 0
    return a.max_turns or -(-g.generate_max_len // (a.max_tokens_per_turn or g.generate_max_len))


def supervised_knobs(cfg: Any, target: Target, job: SupervisedJob) -> Knobs:
    """The settings of a supervised trainer's config (rlrun.config.supervised)."""
    rows = cfg.train.micro_train_batch_size * (2 if job.pairs else 1)
    return Knobs(
        **_training_knobs(cfg, target),
        micro_train=rows,
        micro_rollout=rows,
        seq=cfg.train.max_len,
        response=cfg.train.max_len,
        model_sleep=False,
        engine_sleep=False,
        backend="none",
        vllm_util=0.0,
        vllm_kv_bytes=None,
        rollouts=0,
        kv_budget=None,
        export_critic=job.scalar,
        ref_offload=cfg.loss.ref_offload and target.gpu if job.reference and not job.base_reference else None,
        ref_in_train=job.reference,
        base_reference=job.base_reference,
        sequence_parallel=((job.trained, sp), (Role.REF, sp)) if (sp := cfg.train.sequence_parallel_size) > 1 else (),
    )
