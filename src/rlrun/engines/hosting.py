"""Where a vLLM engine runs: inside the rank (vLLM's `external_launcher`) or in a spawned child process.

vLLM's `external_launcher` builds its process groups over the WHOLE torch.distributed world: every rank must
build an `LLM` with the same configuration, and when only some ranks do, the others wait forever with no error
(measured, shared/VLLM.md D2). So the in-process host is chosen from the layout alone, and only when the engine
ranks are every rank of the world, in consecutive tensor-parallel blocks from rank 0 (vLLM's TP groups are
consecutive world ranks). Every other layout runs each engine in a child process with its own private world.

Why in-process is the default where it is possible (--vllm_engine_host auto): no second process per engine (no
second copy of vLLM's import, no shared-memory hand-over, and on a GPU no second CUDA context beside the actor's),
tensor parallel through vLLM's own workers-in-the-ranks instead of a child with T worker processes and weights
written to /dev/shm, and weights passed to vLLM by reference. `--vllm_engine_host child` keeps the child host
for those layouts too (for example to keep vLLM's side effects out of the trainer's processes).
"""

from __future__ import annotations

from typing import Literal

from rlrun.launch.layout import Layout, Role
from rlrun.runtime.errors import ConfigError

EngineHost = Literal["child", "in_process"]
HostRequest = Literal["auto", "child", "in_process"]


def whole_world_problem(layout: Layout, tensor_parallel_size: int) -> str | None:
    """Why the in-process host cannot serve this layout (None: it can)."""
    world = tuple(range(layout.world_size))
    engine = layout.ranks_of(Role.ENGINE)
    if engine != world:
        return (f"the engine ranks {list(engine)} are not the whole world of {layout.world_size} ranks (vLLM's "
                "external_launcher builds its groups over every rank and hangs when only some build an engine)")
    blocks = tuple(tuple(range(i, i + tensor_parallel_size)) for i in range(0, layout.world_size, tensor_parallel_size))
    if layout.engines != blocks:
        return (f"the engines {[list(e) for e in layout.engines]} are not consecutive blocks of tensor parallel "
                f"{tensor_parallel_size} from rank 0, the groups vLLM builds")
    return None


def choose_host(requested: HostRequest, layout: Layout, tensor_parallel_size: int) -> EngineHost:
    """The host for --generation_backend vllm (ConfigError when in_process is asked on a layout it cannot serve)."""
    problem = whole_world_problem(layout, tensor_parallel_size)
    if requested == "in_process" and problem is not None:
        raise ConfigError(f"--vllm_engine_host in_process: {problem}; use --colocate_all_models (every role and engine "
                          "on every rank) or --vllm_engine_host child (or auto)")
    if requested == "child":
        return "child"
    return "in_process" if problem is None else "child"


def describe(host: EngineHost, tensor_parallel_size: int) -> str:
    if host == "in_process":
        return f"in-process vLLM on every rank (external_launcher, tensor parallel {tensor_parallel_size})"
    return f"vLLM in a child process per engine (tensor parallel {tensor_parallel_size})"
