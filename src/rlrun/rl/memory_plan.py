"""The memory plan of a PPO job (or of rlrun.sft / rlrun.rm / rlrun.dpo: a SupervisedJob): per rank, its peak GPU
bytes and the host bytes it holds, by component, estimated from the models' config.json alone (no weights;
rlrun.rl.memory_estimate over rlrun.rl.model_shapes), and what would make a rank that does not fit its GPU fit.

For each run of ranks (same roles, same numbers) that does not fit, the advice estimates the rank again under each
single change worth trying (--adam_offload, --zero_stage 3, --gradient_checkpointing, --deepspeed_enable_sleep,
--vllm_enable_sleep, vLLM in place of a native/hf engine, a lower --vllm_gpu_memory_utilization, rlrun.dpo's
--ref_offload) and keeps those under which it fits, then more ranks for its models (up to 8x); when no single
change is enough, all of them together, then with more ranks. Apart from the totals, a vLLM engine whose weights
leave under a tenth of its memory to the KV cache is a problem too, with the tensor-parallel size or utilization
that gives it room.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rlrun.config.schema import Config
from rlrun.launch.layout import Layout, Role
from rlrun.rl.memory_estimate import MODEL_ROLES, TRAINED, Bytes, RankMemory, add_bytes, estimate, groups_of, rank_memory
from rlrun.rl.memory_knobs import GIB, GPU_USABLE_FRACTION, Knobs, SupervisedJob, Target, knobs_of, supervised_knobs
from rlrun.rl.model_shapes import ModelShape


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


def _candidates(roles: tuple[Role, ...], k: Knobs, layout: Layout, target: Target, rank: RankMemory,
                shape: ModelShape) -> list[tuple[str, dict[str, Any]]]:
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
        out.append(("--ref_offload" if k.zero_stage == 3 else "--zero_stage 3 --ref_offload",
                    {"ref_offload": True, "zero_stage": 3}))
    if Role.ENGINE in roles and models and not k.model_sleep:
        out.append(("--deepspeed_enable_sleep", {"model_sleep": True}))
    if Role.ENGINE in roles and k.backend == "vllm" and not k.engine_sleep:
        out.append(("--vllm_enable_sleep", {"engine_sleep": True}))
    if Role.ENGINE in roles and k.backend != "vllm" and (tp := vllm_tp(k, shape, target)) is not None:
        # the native/hf engines hold the whole model on every rank; vLLM splits it over its tensor-parallel ranks
        out.append((f"--generation_backend vllm --vllm_tensor_parallel_size {tp}",
                    {"backend": "vllm", "engine_tp": tp}))
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


def _vllm_starved(k: Knobs, shape: ModelShape, tp: int,
                  target: Target) -> tuple[str, tuple[tuple[str, int], ...]] | None:
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
    return (f"vLLM's weights take {weights // tp / GIB:.1f} GiB of its {pool / GIB:.1f} GiB per rank, leaving "
            "too little for its KV cache"), tuple(fixes)


def _problem(group: list[RankMemory], cfg: Config, layout: Layout, shapes: Mapping[Role, ModelShape], k: Knobs,
             target: Target) -> Problem:
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


def plan_memory(cfg: Config, layout: Layout, shapes: Mapping[Role, ModelShape], target: Target,
                job: SupervisedJob | None = None) -> MemoryPlan:
    """Every rank's estimate, and a Problem per run of ranks that does not fit (GPU only). With `job`, `cfg` is a
    supervised trainer's config and `layout` the job's."""
    k = knobs_of(cfg, target) if job is None else supervised_knobs(cfg, target, job)
    ranks = estimate(layout, shapes, k, target)
    problems = [_problem(g, cfg, layout, shapes, k, target)
                for g in groups_of((r for r in ranks if r.fits is False), host=False)]
    if target.gpu and k.backend == "vllm":
        named: set[int] = set()  # engine ranks whose cause a line below names
        for engine in layout.engines:
            starved = _vllm_starved(k, shapes[Role.ENGINE], len(engine), target)
            if starved is not None:
                why, fixes = starved
                named.update(engine)
                problems.append(Problem(engine, (Role.ENGINE,), ranks[engine[0]].gpu_total, fixes, why))
        problems = [p for p in problems if p.why or p.roles != (Role.ENGINE,) or not set(p.ranks) <= named]
    return MemoryPlan(target, k, shapes, ranks, problems, layout.ranks_per_node, job.labels() if job else {})
