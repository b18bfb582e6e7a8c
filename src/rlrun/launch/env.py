"""Who am I? Rank and world from torchrun, a one-task-per-GPU srun, or a plain `python -m`."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from rlrun.runtime.errors import ConfigError

Launcher = Literal["torchrun", "slurm", "single"]
DEFAULT_PORT = 29500
NODE_LABEL_VAR = "RLRUN_NODE_LABEL"
MAX_NODE_LABEL_BYTES = 255  # labels cross ranks in a fixed-size buffer


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: Launcher
    restart_count: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT: 0 on the first attempt

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list -> host names: 'gpu[01-03,7],cpu5' -> gpu01 gpu02 gpu03 gpu7 cpu5;
    text after or between brackets is kept: 'node[1-2]-ib' -> node1-ib node2-ib."""
    hosts: list[str] = []
    # One host expression per top-level comma (commas inside brackets separate ranges).
    for expr in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        names = [""]
        for i, part in enumerate(re.split(r"\[([^\]]*)\]", expr)):  # text, ranges, text, ranges, ..., text
            items = _expand_ranges(part, nodelist) if i % 2 else [part]
            names = [name + item for name in names for item in items]
        hosts.extend(names)
    return hosts


def _expand_ranges(ranges: str, nodelist: str) -> list[str]:
    out: list[str] = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not hi:
            out.append(lo)
            continue
        try:
            start, stop = int(lo), int(hi)
        except ValueError:
            raise ConfigError(f"cannot expand Slurm node list {nodelist!r}: bad range {part!r}") from None
        out.extend(f"{i:0{len(lo)}d}" for i in range(start, stop + 1))
    return out


def _int(environ: Mapping[str, str], key: str) -> int:
    try:
        return int(environ[key])
    except ValueError:
        raise ConfigError(f"environment variable {key}={environ[key]!r} is not an integer") from None


def _slurm_tasks_per_node(environ: Mapping[str, str]) -> int:
    # SLURM_STEP_TASKS_PER_NODE looks like "4(x2)" or "4,3"; the first node's count is ours to use.
    key = "SLURM_STEP_TASKS_PER_NODE" if environ.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    raw = environ.get(key) or "1"
    match = re.match(r"\d+", raw)
    if match is None:
        raise ConfigError(f"environment variable {key}={raw!r} does not start with a task count")
    return int(match.group(0))


def read_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read the launcher's environment. torchrun's RANK wins: under `srun torchrun`, SLURM_PROCID
    is the node index, not the rank. Plain srun counts only inside a job step (SLURM_STEP_ID set),
    so a `python -m rlrun.ppo` in an sbatch script is a world of one, not a hang."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            world_size=_int(env, "WORLD_SIZE"),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else _int(env, "WORLD_SIZE"),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT,
            launcher="torchrun",
            restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT") if "TORCHELASTIC_RESTART_COUNT" in env else 0,
        )
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        world = _int(env, "SLURM_STEP_NUM_TASKS") if "SLURM_STEP_NUM_TASKS" in env else _int(env, "SLURM_NTASKS")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        job_id = _int(env, "SLURM_JOB_ID") if env.get("SLURM_JOB_ID") else 0
        return DistEnv(
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            world_size=world,
            local_world_size=_slurm_tasks_per_node(env),
            master_addr=env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
            # A port derived from the job id keeps two jobs sharing a node apart.
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else 20000 + job_id % 20000,
            launcher="slurm",
            restart_count=_int(env, "SLURM_RESTART_COUNT") if "SLURM_RESTART_COUNT" in env else 0,
        )
    return DistEnv(0, 0, 1, 1, "127.0.0.1", DEFAULT_PORT, "single")


def read_node_label(environ: Mapping[str, str] | None = None) -> str:
    """This node's label for --X_node_label: RLRUN_NODE_LABEL (set by a launch script), else the host name."""
    env = os.environ if environ is None else environ
    label = env.get(NODE_LABEL_VAR) or socket.gethostname()
    if len(label.encode()) > MAX_NODE_LABEL_BYTES:
        raise ConfigError(
            f"{NODE_LABEL_VAR}={label[:40]!r}... is {len(label.encode())} bytes; node labels may have "
            f"at most {MAX_NODE_LABEL_BYTES}"
        )
    return label
