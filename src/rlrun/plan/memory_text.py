"""--dry_run's memory plan as people and tools read it: the models' config.json files read (no weights), the GPU
size found, the plan (rlrun.plan.memory) printed as a compact table with one line per problem and its fixes,
and written as JSON with --plan_json. rlrun.ppo's, and rlrun.sft / rlrun.rm / rlrun.dpo's (supervised_memory)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from rlrun.config.runtime import RuntimeConfig
from rlrun.config.supervised import SupervisedConfig
from rlrun.config.tree import Config
from rlrun.launch.layout import Layout, Role
from rlrun.models.loading import load_model_config
from rlrun.plan.memory import (
    COMPONENTS,
    DEFAULT_GPU_GIB,
    TRAINED,
    MemoryPlan,
    RankMemory,
    frozen_parameters,
    groups_of,
    kv_cache_bytes,
    plan_memory,
    trainable_parameters,
)
from rlrun.plan.shapes import GIB, ModelShape, SupervisedJob, Target, model_shape, role_shapes, unknown_targets
from rlrun.runtime.errors import ConfigError


def target_for(runtime: RuntimeConfig) -> Target:
    """GPUs of --gpu_memory_gb, else of the GPU here; --device cuda with neither: of DEFAULT_GPU_GIB. Otherwise
    (--device cpu, or auto on a machine without a GPU) a CPU run, which is what auto resolves to here."""
    if runtime.device != "cpu" and runtime.gpu_memory_gb is not None:
        return Target(True, int(runtime.gpu_memory_gb * GIB), "--gpu_memory_gb")
    if runtime.device != "cpu" and torch.cuda.is_available():
        return Target(True, torch.cuda.mem_get_info(0)[1], f"detected: {torch.cuda.get_device_name(0)}")
    if runtime.device == "cuda":
        return Target(True, int(DEFAULT_GPU_GIB * GIB), "no GPU here, assumed; set --gpu_memory_gb")
    return Target(False, 0, "--device cpu" if runtime.device == "cpu" else "no GPU here")


def _shape_at(cfg: Config, path: str | None) -> ModelShape:
    return model_shape(load_model_config(dataclasses.replace(cfg.model, pretrain=path)))


def read_shapes(
    cfg: Config, layout: Layout, job: SupervisedJob | None = None
) -> tuple[dict[Role, ModelShape] | None, list[str]]:
    """Each role's model shape from config.json, and notes; (None, [why]) when the policy's is not readable here.
    With `job`, `cfg` is that supervised trainer's (its --pretrain is the trained model; rlrun.dpo's reference
    comes from --ref_pretrain, else the policy)."""
    m = cfg.model
    if m.pretrain is not None and not os.path.isdir(m.pretrain):
        return None, [
            f"memory plan skipped: --pretrain {m.pretrain} is not on this machine (the plan reads its config.json)"
        ]
    try:
        policy = _shape_at(cfg, m.pretrain)
    except (OSError, ValueError) as exc:  # no or unreadable config.json, an architecture transformers does not know
        return None, [f"memory plan skipped: --pretrain {m.pretrain}'s config.json: {exc}".splitlines()[0]]
    except ConfigError as exc:
        return None, [f"memory plan skipped: {exc}"]
    if job is not None:  # cfg.loss: rlrun.dpo's DPOLossConfig
        sources = {Role.REF: ("ref_pretrain", cfg.loss.ref_pretrain)} if job.reference else {}  # type: ignore
    else:  # the critic starts from --critic_pretrain, else the reward model, else the policy (rlrun.models.loading)
        reward, start = cfg.reward.reward_pretrain, cfg.critic.critic_pretrain
        critic = ("critic_pretrain", start) if start else ("reward_pretrain", reward)
        sources = {
            Role.REWARD: ("reward_pretrain", reward),
            Role.CRITIC: critic,
            Role.TEACHER: ("teacher_pretrain", cfg.distill.teacher_pretrain),
        }
    shapes: dict[Role, ModelShape | None] = {role: None for role in sources}
    elsewhere: dict[str, list[str]] = {}
    notes: list[str] = []
    for role, (flag, path) in sources.items():
        if not layout.has(role) or path is None or path == m.pretrain:
            continue
        if not os.path.isdir(path):
            elsewhere.setdefault(f"--{flag} {path}", []).append(role.value)
            continue
        try:
            shapes[role] = _shape_at(cfg, path)
        except (OSError, ValueError, ConfigError) as exc:
            notes.append(
                f"the {role.value} model's config.json ({path}) is unreadable ({str(exc).splitlines()[0]}): "
                "planned with the policy's shape"
            )
    notes += [
        f"{' and '.join(roles)} ({where}): not on this machine, planned with the policy's shape"
        for where, roles in elsewhere.items()
    ]
    shaped = role_shapes(
        policy, shapes.get(Role.CRITIC), shapes.get(Role.REWARD), shapes.get(Role.REF), shapes.get(Role.TEACHER)
    )
    return shaped, notes


def _gib(value: int, digits: int = 1) -> str:
    return f"{value / GIB:.{digits}f}"


def _span(values: list[int]) -> str:
    return str(values[0]) if values[0] == values[-1] else f"{values[0]}-{values[-1]}"


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def format_plan(plan: MemoryPlan) -> str:
    """A table (one row per run of ranks with the same roles and numbers), host memory per node, the models."""
    t = plan.target
    parts = (lambda r: r.gpu) if t.gpu else (lambda r: r.host)
    used = [c for c in COMPONENTS if any(c in parts(r) for r in plan.ranks)]
    digits = 1 if max((r.gpu_total if t.gpu else r.host_total) for r in plan.ranks) >= 10 * GIB else 2  # small models
    header = ("ranks", "nodes", "roles", "phase", *used, "total", *(("fits", "host") if t.gpu else ()))
    rows: list[tuple[str, ...]] = [header]
    for group in groups_of(plan.ranks):
        r = group[0]
        fit = ("yes" if r.fits else "NO", _gib(r.host_total, digits)) if t.gpu else ()
        numbers = [_gib(parts(r)[c], digits) if c in parts(r) else "-" for c in used]
        rows.append(
            (
                _span([g.rank for g in group]),
                _span([group[0].node, group[-1].node]),
                ",".join(plan.label(role.value) for role in r.roles),
                plan.label(r.phase),
                *numbers,
                _gib(r.gpu_total if t.gpu else r.host_total, digits),
                *fit,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    # names left-aligned, numbers right-aligned
    lines = [
        " | ".join(cell.rjust(w) if i > 3 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
        for row in rows
    ]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    title = (
        (
            f"memory plan, GiB per rank at its peak phase, for GPUs of {_gib(t.gpu_bytes)} GiB ({t.source}); a rank "
            f"fits in {_gib(t.usable)} GiB; host = host memory per rank:"
        )
        if t.gpu
        else (
            f"memory plan of a CPU run ({t.source}: every byte is host memory; --gpu_memory_gb N plans for GPUs), "
            "GiB per rank at its peak phase:"
        )
    )
    lora = lora_line(plan)
    return "\n".join([title, *lines, _nodes_line(plan), _models_line(plan), *([lora] if lora else [])])


def _nodes_line(plan: MemoryPlan) -> str:
    nodes = plan.node_host()
    runs: list[tuple[list[int], dict[str, int]]] = []
    for node, host in enumerate(nodes):
        if runs and runs[-1][1] == host:
            runs[-1][0].append(node)
        else:
            runs.append(([node], host))
    digits = 1 if max(sum(host.values()) for host in nodes) >= 10 * GIB else 2
    shown = []
    for members, host in runs:
        what = ", ".join(f"{key} {_gib(host[key], digits)}" for key in COMPONENTS if key in host)
        total = _gib(sum(host.values()), digits)
        shown.append(f"node{'s' if len(members) > 1 else ''} {_span(members)}: {total} GiB ({what})")
    return "host memory per node: " + "; ".join(shown)


def _models_line(plan: MemoryPlan) -> str:
    """The first trained model's shape (the policy; rlrun.rm's scalar-head model), then the other models' sizes
    (a reference only when its shape is not the policy's)."""
    present = {role for r in plan.ranks for role in r.roles}
    first = Role.CRITIC if Role.ACTOR not in present and Role.CRITIC in present else Role.ACTOR
    s = plan.shapes[first]
    head = "; a [hidden, 1] score head in place of the LM head" if first is not Role.ACTOR else ""
    line = (
        f"{plan.labels.get(first.value, 'policy')}: {_billions(s.parameters)} parameters ({s.layers} layers, "
        f"hidden {s.hidden}, {s.heads} heads, {s.kv_heads} KV heads, vocab {s.vocab}{head})"
    )
    for role in (Role.CRITIC, Role.REWARD, Role.REF, Role.TEACHER):
        if role is not first and role in present and (role is not Role.REF or s != plan.shapes[role]):
            line += f"; {plan.label(role.value)}: {_billions(plan.shapes[role].parameters)}"
    return line


def _trained_roles(plan: MemoryPlan) -> list[Role]:
    present = {role for r in plan.ranks for role in r.roles}
    return [role for role in TRAINED if role in present]


def lora_line(plan: MemoryPlan) -> str | None:
    """With --lora_rank, what is trained: each trained model's trainable parameters of all of them (base + adapters,
    as PEFT's print_trainable_parameters counts), and where the reference comes from; None without LoRA."""
    k = plan.knobs
    if k.lora_rank <= 0:
        return None
    parts = []
    for role in _trained_roles(plan):
        s = plan.shapes[role]
        trained = trainable_parameters(role, s, k)
        total = frozen_parameters(role, s, k) + trained
        head = ", its value head included" if role is Role.CRITIC else ""
        parts.append(
            f"{plan.label(role.value)}: {_billions(trained)} trainable parameters of {_billions(total)} "
            f"({100 * trained / total:.2f}%{head})"
        )
    line = f"LoRA rank {k.lora_rank} on {' '.join(k.lora_targets)}: " + "; ".join(parts)
    if k.base_reference:  # no reference model: the saving the layout and the table show
        line += f"; the reference is the {plan.label(Role.ACTOR.value)}'s base (adapters off), no reference model"
    return line


def lora_notes(plan: MemoryPlan) -> list[str]:
    """--target_modules names the plan finds no linear layer for, and MoE layers whose experts' adapters it does not
    count: the trainable count (and the bytes that follow it) is then short of what PEFT builds, or PEFT refuses.
    Said once for the trained models it holds for (the actor and critic often share a shape)."""
    k = plan.knobs
    if k.lora_rank <= 0:
        return []
    said: dict[str, list[str]] = {}
    for role in _trained_roles(plan):
        s = plan.shapes[role]
        unknown = unknown_targets(s, k.lora_targets)
        if unknown:
            names = sorted({linear.path.rsplit(".", 1)[-1] for linear in s.linears})
            said.setdefault(
                f"--target_modules {' '.join(unknown)} matches no linear layer of the model's blocks "
                f"({', '.join(names)}; or all-linear): counted as no adapters (PEFT skips such a name, "
                "and refuses the list when no name matches)",
                [],
            ).append(plan.label(role.value))
        if s.moe_layers:
            said.setdefault(
                f"the adapters PEFT puts on the routed experts and routers of {s.moe_layers} MoE layers "
                "are not counted (fused experts; it varies with the PEFT version): the trainable "
                "parameters are a lower bound",
                [],
            ).append(plan.label(role.value))
    return [f"{' and '.join(roles)}: {text}" for text, roles in said.items()]


def problem_lines(plan: MemoryPlan) -> list[str]:
    """One line per run of ranks that does not fit, naming the changes that would make it fit."""
    lines = []
    for p in plan.problems:
        where = (
            f"{','.join(plan.label(r.value) for r in p.roles)} on rank{'s' if len(p.ranks) > 1 else ''} "
            f"{_span(list(p.ranks))}"
        )
        fixes = ", or ".join(f"{flags} ({_gib(b)} GiB)" for flags, b in p.fixes)
        if p.why:
            lines.append(f"does not fit: {where}: {p.why}; " + (f"fix: {fixes}" if fixes else "use a larger GPU"))
            continue
        text = f"does not fit: {where}: {_gib(p.gpu_bytes)} GiB per GPU > {_gib(plan.target.usable)} GiB usable; "
        tried = f" (tried, alone and together: {'; '.join(p.tried)})" if p.tried else ""
        lines.append(text + (f"fits with {fixes}" if fixes else f"no change fits{tried}: use larger GPUs"))
    return lines


def note_lines(plan: MemoryPlan) -> list[str]:
    """What the numbers assume that a reader would not guess: the native engine batches its generation; engines
    planned without vLLM on a machine without a GPU."""
    k, lines = plan.knobs, []
    engines = [r for r in plan.ranks if Role.ENGINE in r.roles]
    if engines and k.backend == "native":
        rows = -(-k.rollouts // len(engines))
        need = kv_cache_bytes(plan.shapes[Role.ENGINE], k, rows)
        got = min((r.gpu if k.gpu else r.host).get("kv_cache", 0) for r in engines)
        if 0 < got < need:
            budget = "--native_kv_cache_mb" if k.kv_budget else "the GPU's free memory"
            lines.append(
                f"engine ranks: the KV cache of a rank's {rows} rollouts would take {_gib(need)} GiB; the "
                f"native "
                f"engine generates them in ~{-(-need // got)} batches of {_gib(got)} GiB ({budget})"
            )
    if engines and k.gpu and k.backend != "vllm" and not plan.target.source.startswith("detected"):
        lines.append(
            f"engines: planned as --generation_backend {k.backend}, what auto resolves to without a GPU; on "
            f"GPU "
            "nodes with vLLM installed auto picks vllm: pass --generation_backend vllm (vLLM need not be "
            "installed here) to plan that"
        )
    return lines + lora_notes(plan) + longest_lines(plan)


def longest_lines(plan: MemoryPlan) -> list[str]:
    """The longest response each run of model ranks fits at these settings (GPU plans)."""
    if not plan.longest:
        return []
    present = {role for r in plan.ranks for role in r.roles}
    sp = ", ".join(f"{plan.label(role.value)} {size}" for role, size in plan.knobs.sequence_parallel if role in present)
    parts = []
    for ranks, length in plan.longest:
        roles = ",".join(plan.label(role.value) for role in plan.ranks[ranks[0]].roles)
        where = f"rank{'s' if len(ranks) > 1 else ''} {_span(list(ranks))} ({roles})"
        parts.append(f"{where} {length:,} tokens" if length else f"{where} none")
    return [
        f"longest {plan.length_flag} that fits at these settings"
        + (f" (sequence parallelism: {sp})" if sp else "")
        + ": "
        + "; ".join(parts)
    ]


def _component_json(parts: dict[str, int], total: int) -> dict[str, int]:
    return {"total": total, **parts}


def plan_json(plan: MemoryPlan, notes: list[str]) -> dict[str, Any]:
    """The plan as --plan_json writes it (bytes throughout)."""
    t, s, k = plan.target, plan.shapes, plan.knobs

    def rank_json(r: RankMemory) -> dict[str, Any]:
        return {
            "rank": r.rank,
            "node": r.node,
            "roles": [role.value for role in r.roles],
            "phase": r.phase,
            "phases": dict(r.phases),
            "fits": r.fits,
            "memory": {
                "gpu_bytes": _component_json(r.gpu, r.gpu_total),
                "host_bytes": _component_json(r.host, r.host_total),
            },
        }

    return {
        "device": "cuda" if t.gpu else "cpu",
        "gpu_memory_bytes": t.gpu_bytes,
        "gpu_usable_bytes": t.usable if t.gpu else 0,
        "gpu_memory_source": t.source,
        "fits": plan.fits,
        "model": {
            "parameters": s[Role.ACTOR].parameters,
            "critic_parameters": s[Role.CRITIC].parameters,
            "reward_parameters": s[Role.REWARD].parameters,
            "hidden_size": s[Role.ACTOR].hidden,
            # what gets gradients and Adam states: every parameter, or with --lora_rank the adapters
            "trainable_parameters": trainable_parameters(Role.ACTOR, s[Role.ACTOR], k),
            "critic_trainable_parameters": trainable_parameters(Role.CRITIC, s[Role.CRITIC], k),
            "num_hidden_layers": s[Role.ACTOR].layers,
            "vocab_size": s[Role.ACTOR].vocab,
        },
        "settings": dataclasses.asdict(plan.knobs),
        "ranks": [rank_json(r) for r in plan.ranks],
        "nodes": [
            {"node": i, "host_bytes": _component_json(h, sum(h.values()))} for i, h in enumerate(plan.node_host())
        ],
        "problems": [
            {
                "ranks": list(p.ranks),
                "roles": [r.value for r in p.roles],
                "gpu_bytes": p.gpu_bytes,
                "why": p.why,
                "fixes": [{"flags": f, "gpu_bytes": b} for f, b in p.fixes],
            }
            for p in plan.problems
        ],
        "advice": problem_lines(plan),
        "longest_response": [{"ranks": list(ranks), "tokens": length} for ranks, length in plan.longest],
        "notes": notes + note_lines(plan),
    }


def dry_run_memory(
    cfg: Config, layout: Layout, *, write_json: bool, job: SupervisedJob | None = None
) -> tuple[list[str], list[str]]:
    """The plan's printed lines and its problems (warnings); with --plan_json (and `write_json`, rank 0) the JSON
    file too. A plan that cannot be made (the model is elsewhere) is one line saying why; so is the JSON file.
    With `job`, a supervised trainer's plan (`cfg` its config, `layout` the job's)."""
    shapes, notes = read_shapes(cfg, layout, job)
    if job is not None and job.base_reference and cfg.loss.ref_offload:  # type: ignore[attr-defined]
        notes.append(
            "--ref_offload has nothing to offload: with --lora_rank the reference is the policy's base "
            "(adapters off), not a model of its own"
        )
    if shapes is None:
        _write(cfg.runtime.plan_json if write_json else None, {"skipped": notes[0], "ranks": []})
        return notes, []
    plan = plan_memory(cfg, layout, shapes, target_for(cfg.runtime), job)
    _write(cfg.runtime.plan_json if write_json else None, plan_json(plan, notes))
    return [format_plan(plan), *notes, *note_lines(plan)], problem_lines(plan)


def supervised_memory(
    cfg: SupervisedConfig, job: SupervisedJob, world_size: int, ranks_per_node: int, write_json: bool
) -> tuple[list[str], list[str]]:
    """rlrun.sft / rlrun.rm / rlrun.dpo's --dry_run memory plan of `job` (what the trainer holds): dry_run_memory's
    (lines, problems)."""
    run = job.for_config(cfg)  # rlrun.dpo with --lora_rank: the reference is the policy's base, no REF role
    # with `job` the plan reads only the fields a supervised config shares with Config (dry_run_memory)
    return dry_run_memory(cfg, run.layout(world_size, ranks_per_node), write_json=write_json, job=run)  # type: ignore[arg-type]


def _write(path: str | None, document: dict[str, Any]) -> None:
    if path is None:
        return
    try:
        with open(path, "w") as f:
            json.dump(document, f, indent=1)
            f.write("\n")
    except OSError as exc:
        raise ConfigError(f"--plan_json {path}: cannot write it ({exc.strerror}); pass a writable path") from None
