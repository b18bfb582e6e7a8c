"""Process-group init and teardown: the only place the default group is created."""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlrun.launch.env import DistEnv
from rlrun.runtime.errors import ConfigError, RlrunError
from rlrun.runtime.log import get_logger
from rlrun.runtime.phases import bounded_close, report_fatal

# ---- the collective watch ----------------------------------------------------------------------------------------
# An NCCL collective that never completes becomes rlrun's one failure line, not a watchdog abort.
#
# NCCL's watchdog ends a rank whose collective outlives the group's timeout with SIGABRT and a C++ message (and,
# with the flight recorder on, a dump): no Python code runs, so the run's failure line never comes. This thread reads
# PyTorch's flight recorder (the last collectives of every group; on for NCCL runs, `launch.dist`) a little before
# that timeout, and when a collective has been in flight for nearly its group's timeout it writes the recorder's dump
# beside the run and hands the run's failure reporter one error naming the collective, its sequence number and the
# rlrun group (the `group_desc` given in `launch.groups`). The rank then leaves as every failing rank does.
# The cost of firing early: a collective that would have finished in the last `early_s` seconds fails instead.


class CollectiveTimeout(RlrunError):
    """A collective stayed in flight for (nearly) its group's timeout: some rank of the group never joined it."""


@dataclass(frozen=True)
class InFlight:
    """One collective of the flight recorder that has not completed."""

    op: str  # the recorder's profiling name, e.g. "nccl:all_reduce"
    seq: int  # the group's collective sequence number (equal on every rank that joined it)
    group: str  # rlrun's name for the group (its group_desc), else torch's group name
    ranks: str  # the group's global ranks as the recorder gives them ("" when unknown)
    sizes: list[Any]
    age_s: float
    timeout_s: float

    def describe(self) -> str:
        on = f"group {self.group}" + (f" (ranks {self.ranks})" if self.ranks else "")
        return (
            f"collective {self.op} #{self.seq} on {on}, input sizes {self.sizes}, has waited {self.age_s:.0f} s of "
            f"its {self.timeout_s:g} s timeout: a rank of that group never joined it (that rank's own line, or its "
            "stack dump, says where it is)"
        )


def stuck(trace: dict[str, Any], now_ns: int, early_s: float) -> InFlight | None:
    """The oldest collective in `trace` (a flight-recorder dump, parsed JSON) that has not completed and has been in
    flight longer than its own timeout less `early_s`; None when there is none."""
    groups = trace.get("pg_config", {})
    # Numbers as numbers or strings: the JSON dump has stringified some fields in some torch releases.
    for entry in sorted(trace.get("entries", []), key=lambda e: int(e.get("time_created_ns", 0))):
        if (
            entry.get("retired") in (True, "true")
            or entry.get("state") == "completed"
            or entry.get("is_p2p") in (True, "true")
        ):
            continue
        timeout_s = float(entry.get("timeout_ms", 0)) / 1000
        age_s = (now_ns - int(entry.get("time_created_ns", now_ns))) / 1e9
        if timeout_s <= 0 or age_s < timeout_s - early_s:
            continue
        name, desc = (tuple(entry.get("process_group", ())) + ("", ""))[:2]
        ranks = str(groups.get(str(name), {}).get("ranks", ""))
        return InFlight(
            op=str(entry.get("profiling_name", "?")),
            seq=int(entry.get("collective_seq_id", -1)),
            group=str(desc or name),
            ranks="" if ranks == "[]" else ranks,
            sizes=entry.get("input_sizes", []),
            age_s=age_s,
            timeout_s=timeout_s,
        )
    return None


def warning_margin(timeout_s: float) -> tuple[float, float]:
    """(early_s, poll_s): how long before the group's timeout the watch fires, and how often it looks (three looks
    inside the margin, so it fires before NCCL's watchdog does)."""
    early_s = min(15.0, max(0.5, 0.05 * timeout_s))
    return early_s, early_s / 3


class CollectiveWatch:
    """A daemon thread polling `dump()` (the flight recorder as JSON) every `poll_s`; the first stuck collective
    is written to `dump_path` and goes to `report` (which must end the process). A recorder that cannot be read
    is said once through `warn` (NCCL's own watchdog then stays the only bound), never fatal."""

    def __init__(
        self,
        dump: Callable[[], str | bytes],
        timeout_s: float,
        dump_path: str | None,
        report: Callable[[BaseException], None],
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.dump, self.dump_path, self.report, self.warn = dump, dump_path, report, warn
        self.early_s, self.poll_s = warning_margin(timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlrun-collective-watch", daemon=True)

    def start(self) -> CollectiveWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                raw = self.dump()
                found = stuck(json.loads(raw), time.time_ns(), self.early_s)
            except Exception as exc:  # noqa: BLE001 - a recorder that cannot be read must not end a healthy run
                if self.warn is not None:
                    self.warn(
                        f"the collective watch cannot read torch's flight recorder ({type(exc).__name__}: "
                        f"{str(exc)[:160]}); a stuck collective ends in NCCL's own watchdog abort instead"
                    )
                    self.warn = None
                continue
            if found is not None and not self._stop.is_set():
                self.report(CollectiveTimeout(found.describe() + self._save(raw)))
                return

    def _save(self, raw: str | bytes) -> str:
        if self.dump_path is None:
            return ""
        try:
            os.makedirs(os.path.dirname(self.dump_path) or ".", exist_ok=True)
            with open(self.dump_path, "wb") as out:
                out.write(raw.encode() if isinstance(raw, str) else raw)
        except OSError as exc:
            return f"; the flight recorder's dump could not be written ({exc})"
        return f"; flight recorder dump: {self.dump_path}"


def flight_recorder_dump(backend: str) -> Callable[[], str | bytes] | None:
    """This process's flight-recorder dump for `backend` as JSON (in-flight collectives only), or None when torch has
    none."""
    from torch._C import _distributed_c10d as c10d  # noqa: PLC0415 - private API, looked up only where used

    fn = getattr(c10d, "_dump_nccl_trace_json" if "nccl" in backend else "_dump_fr_trace_json", None)
    if fn is None:
        return None
    return lambda: fn(True, True)


def uses_cuda(requested: str) -> bool:
    """Whether --device REQUESTED will put this run on GPUs (resolve_device's choice, without its side effects)."""
    return requested == "cuda" or (requested == "auto" and torch.cuda.is_available())


def resolve_device(requested: str, local_rank: int) -> torch.device:
    """'auto' -> this rank's GPU when CUDA is present, else CPU; sets the current CUDA device."""
    if not uses_cuda(requested):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but torch sees no CUDA device; use --device cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def resolve_device_and_precision(requested: str, local_rank: int, tf32: bool) -> torch.device:
    """resolve_device, then --tf32 on a GPU (process-wide backend flags; the CPU is left as it is)."""
    device = resolve_device(requested, local_rank)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    return device


# NCCL for CUDA tensors with gloo beside it for CPU tensors, in every group (torch's own multi-backend groups).
NCCL_WITH_CPU = "cpu:gloo,cuda:nccl"


def resolve_dist_backend(requested: str, device: torch.device, cpu_collectives: bool = False) -> str:
    """The default group's backend: 'auto' is nccl on a GPU, else gloo. `cpu_collectives`: some role reduces CPU
    tensors over its group (FSDP2 with --adam_offload: the norm of its CPU-offloaded gradients), which an NCCL-only
    group refuses at the first clip ("No backend type associated with device type cpu"): nccl then becomes
    NCCL_WITH_CPU. Only then: a gloo backend per group costs a TCP mesh per group at start-up."""
    backend = requested if requested != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    return NCCL_WITH_CPU if backend == "nccl" and cpu_collectives else backend


def collective_device(backend: str, device: torch.device) -> torch.device:
    """Where tensors for a group with `backend` (dist.get_backend's string) must live: this rank's GPU when NCCL
    carries the group, else the CPU (gloo). A multi-backend group prefers NCCL for speed."""
    return device if "nccl" in backend and device.type == "cuda" else torch.device("cpu")


# PyTorch's NCCL flight recorder: the last collectives of every group, dumped per rank when the watchdog sees a
# timeout, so a hang can be traced to the collective and group that never completed.
NCCL_TRACE_ENTRIES = 2000


def nccl_flight_recorder(trace_dir: str) -> dict[str, str]:
    """Turn on the NCCL flight recorder with its dumps in `trace_dir` (what the user set already is kept); the
    variables in effect. Must run before the first NCCL communicator exists."""
    os.makedirs(trace_dir, exist_ok=True)
    wanted = {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(trace_dir, "nccl_trace_rank_"),
    }
    # The buffer's name since torch 2.11 (the old one still works, with a warning per group: a user's stays).
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        wanted["TORCH_FR_BUFFER_SIZE"] = str(NCCL_TRACE_ENTRIES)
    return {name: os.environ.setdefault(name, value) for name, value in wanted.items()}


def init_distributed(env: DistEnv, backend: str, timeout_s: float, trace_dir: str | None = None) -> None:
    """Create the default group with an explicit timeout (with NCCL and a `trace_dir`, the flight recorder on).

    Under elastic torchrun every attempt gets its own key prefix in the rendezvous store: restarted
    workers otherwise read the previous attempt's gloo addresses from the shared store and fail to
    connect, or hang."""
    timeout = timedelta(seconds=timeout_s)
    keep_worker_threads_serial()  # before gloo's worker threads run anything
    if "nccl" in backend and trace_dir is not None:
        nccl_flight_recorder(trace_dir)
    # No device_id: binding one makes every later new_group an eager communicator split over the whole world,
    # which hangs when a group is made by only some ranks, and fails outright on gloo ("ProcessGroupGloo has no
    # attribute perform_nocolor_split", seen on an H200 with --dist_backend gloo --device cuda). Unbound, NCCL
    # communicators are created at a group's first collective; resolve_device already set the current device.
    if env.world_size == 1 and env.launcher == "single":
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        _init_from_launcher(env, backend, timeout)
    if "nccl" in backend:
        watch_collectives(
            backend, timeout_s, os.path.join(trace_dir, f"stuck_rank_{env.rank}.json") if trace_dir else None
        )


def keep_worker_threads_serial(threads: int | None = None) -> bool:
    """torch ops run on one thread in every thread but this one, which keeps `threads` (default: torch's count now).
    Returns whether it applied: torch's OpenMP runtime (libgomp) is needed; MKL's count is kept where MKL is there.

    gloo's worker threads copy each all_gather's result into place (FSDP2 gathers every unit that way on the CPU,
    rlrun's JSON gathers too), and a copy above 32k elements runs as an OpenMP team of torch's count in that worker.
    Once libgomp manages more threads than the process has CPUs, every team's barrier sleeps in the kernel instead
    of spinning, for the rest of the process. Measured on 2 CPUs with 2 threads: 3,000 [64, 256] x [256, 256]
    matmuls 0.14 s before one 1M-element all_gather and 0.31 s after; the native engine's 64 x 64-token decode in
    rlrun.tinker 0.33 s on the first request, 0.45-0.48 s on every later one. torch's count is a process default
    each thread takes at its first parallel op: it is set to 1, and this thread's own OpenMP and MKL counts back."""
    threads = torch.get_num_threads() if threads is None else threads  # also settles this thread's own count
    libraries = _loaded_libraries()
    if threads <= 1 or "libgomp" not in libraries:
        return False
    torch.set_num_threads(1)
    ctypes.CDLL(libraries["libgomp"]).omp_set_num_threads(threads)
    if torch.get_num_threads() != threads:  # another OpenMP runtime than torch's: leave everything as it was
        torch.set_num_threads(threads)
        return False
    if "libtorch_cpu" in libraries:
        mkl_local = getattr(ctypes.CDLL(libraries["libtorch_cpu"]), "MKL_Set_Num_Threads_Local", None)
        if mkl_local is not None:  # C's entry, by value (the lower-case spellings are Fortran's, by reference)
            mkl_local(threads)
    return True


def _loaded_libraries() -> dict[str, str]:
    """The shared libraries this process has loaded, by name before the first '.' or '-' (the wheels' hashed
    copies, libgomp-a34b3233.so.1, included): their paths."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.split()[-1].startswith("/")}
    except OSError:  # not Linux
        return {}
    return {os.path.basename(p).split(".")[0].split("-")[0]: p for p in sorted(paths) if ".so" in os.path.basename(p)}


def _init_from_launcher(env: DistEnv, backend: str, timeout: timedelta) -> None:
    if env.launcher == "torchrun":
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    else:
        store = dist.TCPStore(
            env.master_addr, env.master_port, env.world_size, is_master=env.rank == 0, timeout=timeout
        )
        rank, world = env.rank, env.world_size
    if env.launcher != "torchrun" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # One store shared by every attempt: key each attempt apart. (With
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every rendezvous round has a fresh store instead, which
        # is the only safe way across nodes: each node's agent counts its own restarts.)
        store = dist.PrefixStore(f"rlrun/attempt{env.restart_count}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


# The collective watch of this process (NCCL runs): stopped before the groups go, so teardown never trips it.
_WATCH: list[CollectiveWatch] = []


def watch_collectives(backend: str, timeout_s: float, dump_path: str | None) -> None:
    """Start the thread that turns a collective stuck for nearly `timeout_s` into the run's one failure line (see
    rlrun.launch.dist); nothing when torch has no flight recorder for `backend`."""
    dump = flight_recorder_dump(backend)
    if dump is not None:
        _WATCH.append(
            CollectiveWatch(
                dump, timeout_s, dump_path, report_fatal, warn=get_logger(dist.get_rank()).warning_once
            ).start()
        )


def restart_safety_warning(env: DistEnv) -> str | None:
    """Multi-node elastic torchrun sharing the agent's store cannot restart reliably (see init_distributed)."""
    if (
        env.launcher == "torchrun"
        and env.world_size > env.local_world_size
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    ):
        return (
            "multi-node torchrun without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a restart after a failure cannot "
            "reconnect the nodes; export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun on every node "
            "(scripts/slurm and scripts/runpod do)"
        )
    return None


# Run by teardown() before the default group goes: users of the default group that must let go first (the
# in-process vLLM engine's tensor-parallel groups).
_BEFORE_TEARDOWN: list[Callable[[], None]] = []


def before_teardown(fn: Callable[[], None]) -> None:
    _BEFORE_TEARDOWN.append(fn)


def world_size() -> int:
    """The default group's size (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def teardown() -> None:
    """Run the before_teardown callbacks (last registered first), then destroy the default group (idempotent).
    Called on every exit path of a normal run; bounded (runtime.faults.CLOSE_BOUND_S: stacks, then exit 1)."""
    with bounded_close():
        while _WATCH:
            _WATCH.pop().stop()
        while _BEFORE_TEARDOWN:
            _BEFORE_TEARDOWN.pop()()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def is_peer_failure(exc: BaseException) -> bool:
    """True when a collective failed because another rank died or timed out (not this rank's bug)."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text
        for marker in (
            "Connection closed by peer",
            "Connection reset by peer",
            "Timed out",
            "timed out",
            "Broken pipe",
            "NCCL",
            "gloo",
            "ProcessGroup",
            "Socket Timeout",
        )
    )
