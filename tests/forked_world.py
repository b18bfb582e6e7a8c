"""Worlds of real rank processes forked from one parent that has already imported torch, transformers and rlrun.

Every multi-rank test starts fresh processes, and on 2 cores each of them spends ~5 s of CPU importing torch,
transformers and rlrun before its first collective (a 4-rank world ~10 s of wall time, a suite thousands of
processes). The parent here pays that once per session; each world's ranks are `fork`ed from it, as
torch.multiprocessing's fork start method starts its workers, and then run exactly what `python -m MODULE ARGS`
(or `python PATH ARGS`) runs: the module as `__main__`, its own process group over gloo, its own exit.

What a rank sees is what torchrun gives it (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT,
TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT=0): rlrun takes it for a torchrun world, rank 0 hosts the
rendezvous store. What is not torchrun here is its agent: elastic restarts, its ChildFailedError summary and its
exit code on a failure (always 1 here too). Tests that assert those, pass `max_restarts`, or set environment
variables a module reads when it is imported (HF_HUB_CACHE, ...) start real torchrun (helpers.run_rlrun decides);
tests/test_ppo_cli.py, tests/launch and the resume tests keep torchrun's agent under test.

Protocol: the client sends one JSON request per connection; the server forks a supervisor (a new process group)
that answers {"pgid"}, forks the ranks, waits for them and answers {"rc", "ranks"}. A rank that fails makes the
supervisor SIGTERM the others and SIGKILL them 30 s later, as torchrun's agent does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

# Variables read by a module when it is imported (huggingface_hub's HF_HOME, torch's TORCH_LOGS, ...) must be the
# same as when the server imported them; these are read only while a run runs.
# (PYTORCH_NVML_BASED_CUDA_CHECK: importing deepspeed sets it, in the test process too; torch reads it per call.
# HF_HUB_DISABLE_PROGRESS_BARS, TQDM_DISABLE: rlrun.runtime.log.quiet_third_party sets both in every rank, and in
# the test process when a test calls it, and switches an already imported hub off in place.)
RUNTIME_VARS = ("RLRUN_", "WANDB_", "PYTEST_CURRENT_TEST", "PYTORCH_NVML_BASED_CUDA_CHECK",
                "HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE",
                "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID",  # rlrun.run.preemption, rlrun.checkpoint.resume
                "PYTHONPATH")  # a rank puts its entries on its path (_on_path): packages a run imports by name
ENTRY_MODULES = ("rlrun.ppo", "rlrun.sft", "rlrun.rm", "rlrun.dpo")
# What a rank imports later anyway (the tiny models' classes, the curves' matplotlib); never deepspeed or vLLM, whose
# presence changes how a run behaves (rlrun.launch.failures.leave) and which set process-wide state when imported.
PRELOAD = (*ENTRY_MODULES, "rlrun.rl.trainer", "rlrun.rl.assembly", "rlrun.reporting.summary",
           "transformers.models.qwen2.modeling_qwen2", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe",
           "transformers.models.mixtral.modeling_mixtral", "transformers.generation",
           "matplotlib.figure", "matplotlib.backends.backend_agg", "matplotlib.ticker")
TERM_GRACE_S = 30.0  # torchrun's agent: SIGTERM, then SIGKILL after 30 s


def import_time_differences(env: dict[str, str], server_env: dict[str, str],
                            set_by_imports: dict[str, str]) -> list[str]:
    """The variables, other than those read only at run time, in which `env` differs from the environment the
    server imported under (`server_env`; a variable its imports set counts as the same where `env` has its value
    or none)."""
    keys = set(env) | set(server_env)
    return sorted(
        k for k in keys
        if env.get(k) != server_env.get(k) and not k.startswith(RUNTIME_VARS)
        and not (k in set_by_imports and env.get(k, set_by_imports[k]) == set_by_imports[k])
    )


# ---- server ---------------------------------------------------------------------------------------------------


def serve(sock_path: str) -> None:
    """Import once, then fork one supervisor per request. Nothing here may start a thread or register an atexit
    handler: every rank inherits this process's state."""
    import importlib

    before = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    # A fresh process would set these while importing (torch: TORCHINDUCTOR_CACHE_DIR); every rank does so too.
    set_by_imports = {k: v for k, v in os.environ.items() if k not in before}
    for name in ENTRY_MODULES:  # runpy runs them as __main__; a cached copy would make it warn on every rank
        sys.modules.pop(name, None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(16)
    listener.settimeout(5.0)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    parent = os.getppid()
    print(json.dumps({"ready": True, "env": before, "set_by_imports": set_by_imports}), flush=True)
    while os.getppid() == parent:  # a session that died without stopping the server ends it within 5 s
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        request = json.loads(_read_line(conn))
        if os.fork() == 0:
            listener.close()
            _supervise(conn, {**request, "env": {**set_by_imports, **request["env"]}})  # never returns
        conn.close()


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("client went away")
        data += chunk
    return data.decode()


def _send(conn: socket.socket, message: dict) -> None:
    conn.sendall((json.dumps(message) + "\n").encode())


def _supervise(conn: socket.socket, request: dict) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    _send(conn, {"pgid": os.getpgrp()})
    world = len(request["argv"])
    pids = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            conn.close()
            _become_rank(request, rank, world)
        pids[pid] = rank
    codes: dict[int, int] = {}
    term_at: float | None = None
    while len(codes) < world:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if term_at is not None and time.monotonic() - term_at > TERM_GRACE_S:
                _signal_all(pids, codes, signal.SIGKILL)
            time.sleep(0.02)
            continue
        code = os.waitstatus_to_exitcode(status)
        codes[pids[pid]] = code
        if code != 0 and term_at is None:
            term_at = time.monotonic()
            _signal_all(pids, codes, signal.SIGTERM)
    ranks = [codes[r] for r in range(world)]
    _send(conn, {"rc": 0 if not any(ranks) else 1, "ranks": ranks})
    os._exit(0)


def _signal_all(pids: dict[int, int], codes: dict[int, int], sig: signal.Signals) -> None:
    for pid, rank in pids.items():
        if rank not in codes:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def _become_rank(request: dict, rank: int, world: int) -> None:
    """Turn this forked process into `python -m MODULE ARGV` (or `python PATH ARGV`) of one rank; exits through
    the interpreter's own exit (atexit handlers, finalization), as a fresh process would."""
    import runpy

    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    env = dict(request["env"])
    if request["torchrun_env"]:
        env.update({
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world),
            "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(request["port"]),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": request["run_id"], "TORCHELASTIC_USE_AGENT_STORE": "False",
        })
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    _on_path(env.get("PYTHONPATH", ""))
    for fd, path in ((1, request["out"][rank]), (2, request["err"][rank])):
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(target, fd)
        os.close(target)
    kind, name = request["target"]
    sys.argv = [name, *request["argv"][rank]]
    if kind == "path":
        sys.path[0] = os.path.dirname(os.path.abspath(name))
        runpy.run_path(name, run_name="__main__")
    else:
        sys.path[0] = request["cwd"]
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    sys.exit(0)


def _on_path(pythonpath: str) -> None:
    """PYTHONPATH's entries this process's path lacks, put where the interpreter puts them at start-up (after the
    script's folder): a package the run imports by name (a verifiers taskset id) is found. A module the server
    imported before the fork stays the one it imported."""
    missing = [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p and os.path.abspath(p) not in sys.path]
    sys.path[1:1] = missing


# ---- client ---------------------------------------------------------------------------------------------------


class Server:
    """The session's forking server: started on first use, stopped when the session ends."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.sock_path = str(workdir / "forked_world.sock")
        with open(workdir / "server.err", "wb") as err:
            self.proc = subprocess.Popen([sys.executable, __file__, "serve", self.sock_path], env=env,
                                         stdout=subprocess.PIPE, stderr=err, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            raise RuntimeError(f"forked_world server did not start: {(workdir / 'server.err').read_text()[-3000:]}")
        ready = json.loads(line)
        self.env: dict[str, str] = ready["env"]
        self.set_by_imports: dict[str, str] = ready["set_by_imports"]

    def run(self, target: tuple[str, str], argv: list[list[str]], env: dict[str, str], cwd: Path,
            out: list[Path], err: list[Path], port: int, timeout: float,
            torchrun_env: bool = True) -> tuple[int, list[int]]:
        """Run one world of len(argv) ranks, rank r with argv[r], its stdout appended to out[r] and its stderr to
        err[r]; (torchrun-like exit code, each rank's exit code). On `timeout` every rank is killed and
        subprocess.TimeoutExpired raised, as subprocess.run does."""
        request = {"target": list(target), "argv": argv, "env": env, "cwd": str(cwd), "out": [str(p) for p in out],
                   "err": [str(p) for p in err], "port": port,
                   "run_id": env.get("TORCHELASTIC_RUN_ID") or uuid.uuid4().hex,  # torchrun --rdzv_id, or its own
                   "torchrun_env": torchrun_env}
        deadline = time.monotonic() + timeout
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.sock_path)
            _send(conn, request)
            conn.settimeout(timeout)
            reader = conn.makefile("r")
            pgid = json.loads(reader.readline())["pgid"]
            try:
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                answer = reader.readline()
            except TimeoutError:
                answer = ""
            if not answer:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                raise subprocess.TimeoutExpired(f"forked world {target}", timeout)
            result = json.loads(answer)
        return result["rc"], result["ranks"]

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    serve(sys.argv[2])
