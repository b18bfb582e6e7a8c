"""Host a vLLM engine in a spawned child process, driven over a Pipe.

Why a child: vLLM's in-process `external_launcher` builds its groups over the whole torch.distributed
world and hangs when only some ranks build an engine. A child has its own private vLLM world (the
torchrun variables are removed from its environment), so any rank can own one.

Protocol (parent -> child, one reply each but for a stream): ("start", EngineSpec) -> ready; ("weights",) -> ack
(tensor parallel > 1: the parent wrote the weights file the workers read); ("stream", Handoff|None, bucket
plan|None), then ("bucket", k) for each bucket, each acked with k once the child copied it out of the parent's
staging buffer, and one ack once vLLM has them all (tensor parallel 1: engines/vllm/stream.py); ("generate",
prompts, seeds, Sampling) -> (tokens, logprobs); ("sleep",) -> ack (GPU --vllm_enable_sleep); ("stop",) -> bye.
Replies are ("ok", payload) or ("error", "Type: message").

Every read on the parent side has a deadline and checks that the child is alive, so a child that
dies, hangs or fails to start becomes one EngineChildError line, never a hang. The child dies with
its parent (PR_SET_PDEATHSIG on Linux).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch.multiprocessing as tmp

from rlrun.engines.vllm.adapter import EngineSpec
from rlrun.engines.vllm.stream import ChildLinkError, StreamState, streamed_weights

# torchrun / elastic variables: a child that sees them would think it is a rank of the trainer's world.
_SCRUB_EXACT = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
)
_SCRUB_PREFIXES = ("TORCHELASTIC_", "GROUP_", "ROLE_", "MASTER_")
# Test hook: RLRUN_VLLM_CHILD_FAULT="request:N[+][:kill|hang][,...]" (request: start, weights, stream, generate or
# sleep) makes the child SIGKILL itself (as an out-of-memory kill would) or stop answering on the engine's N-th
# (0-based; "N+": N-th and every later) such request. Counted over the engine's children: a restarted child
# (rlrun.engines.vllm.engine) goes on from the requests its predecessors were sent.
FAULT_ENV = "RLRUN_VLLM_CHILD_FAULT"
_PR_SET_PDEATHSIG = 1
# Not one vLLM handles itself, nor a preemption notice (SIGTERM, SIGUSR1: rlrun.run.preemption), which Slurm sends
# to every process of the job: the notice is the parent rank's to act on, so the child ignores it.
_DEATH_SIGNAL = signal.SIGUSR2
_NOTICES = (signal.SIGTERM, signal.SIGUSR1)


class EngineChildError(ChildLinkError):
    """The vLLM engine child process failed, died or stopped answering."""


class RestartBudget:
    """How many times an engine's child may be replaced: at most `max_restarts` within any `window_s` seconds
    (--max_engine_restarts, --engine_restart_window); one more failure ends the job with one line."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts, self.window_s = max_restarts, window_s
        self.times: deque[float] = deque()
        self.total = 0  # restarts over the run, for the engine/restarts metric

    def spend(self, failure: ChildLinkError, now: float | None = None) -> None:
        """Count one restart after `failure`, or raise it as the job's end when the window's budget is spent."""
        if self.max_restarts == 0:
            raise failure
        now = time.monotonic() if now is None else now
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if len(self.times) >= self.max_restarts:
            raise EngineChildError(
                f"{failure}; not restarted again: {len(self.times)} of {self.max_restarts} restarts "
                f"(--max_engine_restarts) within the last {self.window_s:g} s (--engine_restart_window) are spent; a "
                "failure that repeats on every restart is no transient one: its log says why"
            )
        self.times.append(now)
        self.total += 1


def scrub_torchrun_env(env: dict[str, str]) -> None:
    for key in list(env):
        if key in _SCRUB_EXACT or key.startswith(_SCRUB_PREFIXES):
            del env[key]


def _die_with_parent(parent_pid: int) -> None:
    """The child leads a process group of its own, which vLLM's helper processes (tensor parallel: the engine core
    and its workers) join. The parent's death (SIGKILL included: PR_SET_PDEATHSIG) and a "stop" end the whole
    group, so no vLLM process outlives the rank that owns it."""
    os.setpgrp()
    signal.signal(_DEATH_SIGNAL, lambda *_: os.killpg(0, signal.SIGKILL))
    for notice in _NOTICES:  # the parent finishes its step with this engine, then stops it with "stop" or SIGKILL
        signal.signal(notice, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, _DEATH_SIGNAL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os.killpg(0, signal.SIGKILL)


def _redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def child_main(conn: Connection, parent_pid: int, log_path: str, sent_before: dict[str, int]) -> None:
    """Entry point of the child (spawned; runs until "stop" or the parent's death). `sent_before`: the requests of
    each kind the engine's earlier children were sent (the fault hook counts from there)."""
    _die_with_parent(parent_pid)
    _redirect_output(log_path)
    scrub_torchrun_env(os.environ)  # type: ignore[arg-type]
    fault = os.environ.get(FAULT_ENV, "")
    from rlrun.engines.vllm.adapter import VLLMAdapter  # noqa: PLC0415

    adapter = None
    stream = StreamState()
    seen = dict(sent_before)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return  # the parent closed the pipe
        kind = msg[0]
        _maybe_fault(fault, kind, seen.get(kind, 0))
        seen[kind] = seen.get(kind, 0) + 1
        try:
            if kind == "start":
                t0 = time.perf_counter()
                adapter = VLLMAdapter(msg[1])
                conn.send(("ok", time.perf_counter() - t0))
            elif kind == "weights":  # tensor parallel > 1: the parent wrote the file the workers read
                assert adapter is not None
                adapter.reload_weights(None)
                conn.send(("ok", None))
            elif kind == "stream":  # weights bucket by bucket through the staging buffers (engines/vllm/stream.py)
                assert adapter is not None
                stream.update(msg[1], msg[2])
                adapter.reload_weights(streamed_weights(conn, stream))
                conn.send(("ok", None))
            elif kind == "adapter":  # a LoRA policy: the adapters of the sync that just ended (engines/vllm/lora.py)
                assert adapter is not None
                adapter.load_adapter(msg[1])
                conn.send(("ok", None))
            elif kind == "generate":
                assert adapter is not None
                conn.send(("ok", adapter.generate(*msg[1:])))
            elif kind == "sleep":  # until the next weights or generate request, which wake it
                assert adapter is not None
                adapter.sleep()
                conn.send(("ok", None))
            elif kind == "stop":
                if adapter is not None:
                    adapter.close()
                conn.send(("ok", None))
                return
            else:
                conn.send(("error", f"unknown request {kind!r}"))
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it as one line
            traceback.print_exc()
            sys.stderr.flush()
            first = (str(exc).strip().splitlines() or [""])[0]
            conn.send(("error", f"{type(exc).__name__}: {first}"))
            if kind == "start":
                return


def fault_action(spec: str, kind: str, index: int) -> str | None:
    """What FAULT_ENV's `spec` does on the `index`-th request of `kind`: "kill", "hang" or None."""
    for item in filter(None, spec.split(",")):
        parts = item.split(":")
        at = parts[1] if len(parts) > 1 else ""
        hit = at == str(index) or (at.endswith("+") and at[:-1].isdigit() and index >= int(at[:-1]))
        if parts[0] == kind and hit:
            return "hang" if parts[2:3] == ["hang"] else "kill"
    return None


def _maybe_fault(spec: str, kind: str, index: int) -> None:
    action = fault_action(spec, kind, index)
    if action is None:
        return
    print(f"injected fault ({FAULT_ENV}={spec}: {action} on {kind} request {index})", file=sys.stderr, flush=True)
    if action == "hang":
        while True:
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)


def _tail(path: str, lines: int = 3) -> str:
    try:
        with open(path, errors="replace") as f:
            last = deque((line.rstrip() for line in f if line.strip()), maxlen=lines)
    except OSError:
        return "(no log)"
    return " | ".join(line[-300:] for line in last) or "(empty log)"


class EngineChild:
    """Parent-side handle of one vLLM child. start() returns at once; requests block until the reply."""

    def __init__(
        self,
        spec: EngineSpec,
        log_path: str,
        timeout_s: float,
        on_ready: Callable[[float], None] | None = None,
        sent_before: dict[str, int] | None = None,
    ) -> None:
        """`sent_before`: the requests of each kind an engine's earlier children were sent (a restart's child)."""
        self.spec, self.log_path, self.timeout_s = spec, log_path, timeout_s
        self.sent = dict(sent_before or {})  # requests sent by kind, this child's predecessors' included
        self.on_ready = on_ready  # called once with the spawn -> ready seconds
        self.ready = False
        self.start_s: float | None = None  # spawn -> ready
        ctx = tmp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self._t_spawn = time.perf_counter()
        # Not daemonic: vLLM may start helper processes, which daemonic processes cannot.
        self.proc = ctx.Process(
            target=child_main, args=(child_conn, os.getpid(), log_path, dict(self.sent)), name="rlrun-vllm-engine"
        )
        self.proc.start()
        child_conn.close()
        self.conn.send(("start", spec))
        self._count("start")

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def wait_ready(self) -> None:
        if self.ready:
            return
        self.reply("starting vLLM")
        self.ready = True
        self.start_s = time.perf_counter() - self._t_spawn
        if self.on_ready is not None:
            self.on_ready(self.start_s)

    def request(self, doing: str, *msg: object) -> object:
        self.send(doing, *msg)
        return self.reply(doing)

    def send(self, doing: str, *msg: object) -> None:
        """A message without waiting for a reply (a weight stream's: one request, several messages and replies)."""
        self.wait_ready()
        try:
            self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self._raise_dead(doing)
        self._count(str(msg[0]))

    def _count(self, kind: str) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + 1

    def reply(self, doing: str) -> object:
        """The next reply's payload, within --dist_timeout (EngineChildError on an error reply or a dead child)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.conn.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                try:
                    status, payload = self.conn.recv()
                except (EOFError, ConnectionResetError, OSError):
                    self._raise_dead(doing)
                if status == "ok":
                    return payload
                self.kill()
                raise EngineChildError(
                    f"vLLM engine child (pid {self.pid}) failed while {doing}: {payload} "
                    f"(log {self.log_path}: {_tail(self.log_path)})"
                )
            if not self.proc.is_alive():
                self._raise_dead(doing)
            if time.monotonic() >= deadline:
                self.kill()
                raise EngineChildError(
                    f"vLLM engine child (pid {self.pid}) did not answer within {self.timeout_s:g} s "
                    f"while {doing} (--dist_timeout); it was stopped (log {self.log_path}: "
                    f"{_tail(self.log_path)})"
                )

    def _raise_dead(self, doing: str) -> None:
        self.proc.join(timeout=5)
        code = self.proc.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        raise EngineChildError(
            f"vLLM engine child (pid {self.pid}) died while {doing} ({how}); last lines of its "
            f"log {self.log_path}: {_tail(self.log_path)}"
        )

    def kill(self) -> None:
        """The child and every process of its group (vLLM's engine core and workers with tensor parallel > 1)."""
        if self.proc.pid is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # the group is gone already
        self.proc.join(timeout=10)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the child to exit; kill it if it does not within timeout_s."""
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
                if self.conn.poll(timeout_s):
                    self.conn.recv()
            except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                pass
            self.proc.join(timeout=timeout_s)
        self.kill()
        self.conn.close()
