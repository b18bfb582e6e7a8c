"""Helpers shared by the multi-process tests (a module name no other test folder uses)."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]


# The demo for 3 steps, with a prompt template (so a rerun from its config.yaml sees a value with a newline in it).
# tests/rl/conftest.py's demo_3 fixture runs it once on 2 ranks for the tests that read that run.
DEMO_3 = ["--config", "configs/demo.yaml", "--max_steps", "3", "--input_template", "Q: {}\nA:"]


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "RLRUN_NO_PROGRESS": "1",
                "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


@dataclass
class RunResult:
    returncode: int
    output: str
    metrics: list[dict]


def run_rlrun(nproc: int, args: list[str], save_path: Path, timeout: float = 240, env: dict | None = None,
              module: str = "rlrun.ppo", max_restarts: int = 0, agent: bool = False) -> RunResult:
    """`torchrun --standalone --nproc_per_node N [--max-restarts R] -m MODULE ARGS --save_path SAVE_PATH` (or plain
    python for N=0), as run_module_world runs it."""
    args = args + ["--save_path", str(save_path)]
    returncode, output = run_module_world(nproc, module, args, env or subprocess_env(), timeout, max_restarts, agent)
    return RunResult(returncode, output, read_metrics(save_path))


# Keys whose values are wall-clock measurements: equal runs differ in them and only in them.
TIMED_KEYS = ("time/", "tokens_per_s", "perf/", "eval/time")


def untimed(metrics: list[dict]) -> list[dict]:
    """METRICS without their wall-clock keys (TIMED_KEYS): what two equal runs must agree on exactly."""
    return [{k: v for k, v in m.items() if not k.startswith(TIMED_KEYS)} for m in metrics]


def read_metrics(save_path: Path) -> list[dict]:
    """The records of SAVE_PATH/metrics.jsonl ([] where the run wrote none)."""
    metrics_file = save_path / "metrics.jsonl"
    return [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []


def run_module_world(nproc: int, module: str, args: list[str], env: dict[str, str], timeout: float,
                     max_restarts: int = 0, agent: bool = False) -> tuple[int, str]:
    """(exit code, stdout + stderr) of `torchrun --standalone --nproc_per_node N -m MODULE ARGS` (plain python for
    N=0). The ranks are forked from the session's pre-imported server (tests/forked_world.py) unless the test needs
    torchrun's agent (`agent`: its failure report is asserted; `max_restarts`), `env` sets a variable read at import
    time, or RLRUN_TEST_LAUNCHER=torchrun asks for torchrun throughout. subprocess.TimeoutExpired after `timeout`
    s, every rank killed."""
    server = forked_server(env) if max_restarts == 0 and not agent else None
    if server is not None:
        world = max(nproc, 1)
        with tempfile.TemporaryDirectory(prefix="rlrun_world") as logs:
            out, err = Path(logs) / "out", Path(logs) / "err"
            returncode, _ = server.run(("module", module), [args] * world, env, REPO, [out] * world, [err] * world,
                                       free_port(), timeout, torchrun_env=nproc > 0)
            return returncode, (out.read_text() if out.exists() else "") + (err.read_text() if err.exists() else "")
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               f"--max-restarts={max_restarts}", "-m", module]
    else:
        cmd = [sys.executable, "-m", module]
    # A session of its own, so that a timeout takes the workers down with the launcher.
    proc = subprocess.Popen(cmd + args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return proc.returncode, stdout + stderr


_SERVER: list = []
_STARTING = threading.Lock()


def forked_server(env: dict[str, str]):
    """The session's forked_world.Server (started on first use), or None where `env` cannot be served by it."""
    import atexit

    import forked_world

    if os.environ.get("RLRUN_TEST_LAUNCHER") == "torchrun":
        return None
    with _STARTING:  # worlds are started from threads at once
        if not _SERVER:
            server = forked_world.Server(Path(tempfile.mkdtemp(prefix="forked_world")), subprocess_env())
            atexit.register(server.stop)
            _SERVER.append(server)
    server = _SERVER[0]
    differences = forked_world.import_time_differences(env, server.env, server.set_by_imports)
    if differences and os.environ.get("RLRUN_TEST_LAUNCHER_LOG"):
        with open(os.environ["RLRUN_TEST_LAUNCHER_LOG"], "a") as log:
            log.write(f"{os.environ.get('PYTEST_CURRENT_TEST')}: {differences}\n")
    return None if differences else server


_HANDED_OUT: set[int] = set()
_HANDING_OUT = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a test's own rendezvous), never one this process
    handed out before: worlds started from threads at once must not share a rendezvous port."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with _HANDING_OUT:
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


@functools.cache
def _refusing_socket() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def refusing_port() -> int:
    """A port on 127.0.0.1 whose connects are refused for as long as the tests run: bound in this process and never
    listening. A port merely found free and let go (free_port) can be taken by another socket (a rank's gloo pair
    binds ephemeral ports) before the call, which is then accepted and never answered instead of refused."""
    return _refusing_socket().getsockname()[1]


def run_file_as_ranks(path: str, world: int, outdir: Path, timeout: float) -> None:
    """Start `python PATH RANK WORLD PORT OUTDIR` for every rank of a fresh gloo world on a free port, wait for
    all of them (at most `timeout` seconds in total) and fail with the tail of each one's output if any did not
    exit cleanly. The file's `__main__` block is the per-rank worker; it writes its results under OUTDIR. The ranks
    are forked from the session's pre-imported server where it can serve them (see run_rlrun)."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # Each rank writes to a file, not a pipe: a rank blocked on a full pipe that nobody reads yet (while the
    # test waits on another rank) would hang both in their next collective.
    logs = [outdir / f"rank{r}.log" for r in range(world)]
    for log in logs:
        log.write_text("")
    argv = [[str(r), str(world), str(port), str(outdir)] for r in range(world)]
    server = forked_server(env)
    if server is not None:
        _, codes = server.run(("path", path), argv, env, REPO, logs, logs, port, timeout, torchrun_env=False)
    else:
        codes = _run_processes([[sys.executable, path, *a] for a in argv], env, logs, timeout)
    assert all(c == 0 for c in codes), "\n".join(
        f"rank {r} (exit {c}):\n{log.read_text()[-3000:]}" for r, (c, log) in enumerate(zip(codes, logs)))


def _run_processes(cmds: list[list[str]], env: dict[str, str], logs: list[Path], timeout: float) -> list[int]:
    """Start every command with its output in its log file; their exit codes (at most `timeout` s in all)."""
    import time

    procs = []
    for cmd, log in zip(cmds, logs):
        with open(log, "w") as sink:
            procs.append(subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs]


def stop_process(proc: subprocess.Popen, timeout: float = 15) -> int | None:
    """SIGTERM a server started with start_new_session=True; SIGKILL its process group if it lingers."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)
    return proc.returncode


def start_reward_server(reward_file: Path, log_dir: Path, extra_args: list[str] | None = None,
                        env_extra: dict[str, str] | None = None, timeout: float = 60) -> tuple[subprocess.Popen, int]:
    """`python -m rlrun.reward_server --reward_file FILE --port 0` on 127.0.0.1: (process, port) once it listens.
    Its output goes to LOG_DIR/server.out and server.err; stop it with stop_process."""
    import time

    out_path, err_path = log_dir / "server.out", log_dir / "server.err"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "rlrun.reward_server", "--reward_file", str(reward_file),
                                 "--host", "127.0.0.1", "--port", "0", *(extra_args or [])],
                                stdout=out, stderr=err, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = out_path.read_text()
        if "listening on http://127.0.0.1:" in text:
            return proc, int(text.split("listening on http://127.0.0.1:", 1)[1].split()[0])
        if proc.poll() is not None:
            raise AssertionError(f"reward server exited {proc.returncode}: {err_path.read_text()}")
        time.sleep(0.05)
    stop_process(proc)
    raise AssertionError(f"reward server did not start in {timeout} s: {err_path.read_text()}")


def teach_tiny_model(out: Path, trajectories: list[list[tuple[str, bool]]], *, max_positions: int = 512,
                     steps: int = 150, max_loss: float = 0.05) -> None:
    """The embedded tiny model, taught by teacher forcing (seconds on CPU) to reproduce each trajectory: a list
    of (text, trained) pieces, loss on the `trained` ones, EOS after the last. Saved with its tokenizer to
    `out`. For tests that need a policy that already writes a protocol (a random tiny model never writes
    `<search>`); everything the trainer then does with it is real. Trajectories that disagree teach a
    distribution (their loss cannot reach 0: raise `max_loss`)."""
    import torch

    from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config

    tok = build_byte_tokenizer()
    config = tiny_model_config()
    config.max_position_embeddings = max_positions
    model = build_causal_lm(config, seed=0)
    rows = []
    for pieces in trajectories:
        ids: list[int] = []
        mask: list[float] = []
        for text, trained in pieces:
            piece = tok.encode(text, add_special_tokens=False)
            ids += piece
            mask += [float(trained)] * len(piece)
        rows.append((torch.tensor(ids + [tok.eos_token_id]), torch.tensor(mask + [1.0])))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        for ids, mask in rows:
            logits = model(input_ids=ids[None, :-1]).logits[0]
            loss = (torch.nn.functional.cross_entropy(logits, ids[1:], reduction="none") * mask[1:]).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert loss.item() < max_loss, loss.item()
    model.save_pretrained(out)
    tok.save_pretrained(out)


def value_tokens(info) -> list[str]:  # type: ignore[no-untyped-def]  - a rlrun.config.fields.FieldInfo
    """Values differing from the config field's default, as command-line tokens (flag-translation tests)."""
    from typing import Literal, get_args, get_origin

    tp = info.type
    if type(None) in get_args(tp):
        tp = next(a for a in get_args(tp) if a is not type(None))
    if tp is bool:
        return []
    if get_origin(tp) is tuple:
        return ["-3", "4"]
    if get_origin(tp) is Literal:
        return [next(str(c) for c in get_args(tp) if c != info.default)]
    return {int: ["7"], float: ["0.25"], str: ["some/value"]}[tp]


class LargestRows(TorchDispatchMode):
    """The largest number of rows of any new tensor whose last dimension is the vocabulary."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view (weight.t()) or an in-place op: nothing new allocated
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


class WholeStrategy:
    """One rank holding the whole model: its full state is its state dict (export tests without a process group)."""

    def full_state_dict(self, model):  # type: ignore[no-untyped-def]
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    @contextlib.contextmanager
    def export_view(self, model):  # type: ignore[no-untyped-def]
        from rlrun.strategies.blocks import ParamBlock

        yield model, [ParamBlock(list(model.named_parameters()))]


def save_tiny_base(path: Path, seed: int = 5) -> str:
    """A tiny causal LM and the byte tokenizer saved with save_pretrained to `path` (a base model directory)."""
    from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config

    build_causal_lm(tiny_model_config(), seed=seed).save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return str(path)


def save_trained_adapter(source, out: Path):  # type: ignore[no-untyped-def]  - a PretrainedConfig; the nn.Module saved
    """A LoRA policy of `source` whose adapters moved off their start (noise 0.1), saved to `out` as --save_path holds
    it (with --save_merged): an adapter directory for --pretrain."""
    from rlrun.models.loading import load_tokenizer, policy_weights, unfilled_trained_policy
    from rlrun.models.lora import is_adapter
    from rlrun.roles.export import save_causal_lm

    model = unfilled_trained_policy(source, 0, policy_weights(source, 0)).fill(torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    save_causal_lm(model, load_tokenizer(source), str(out), is_writer=True, strategy=WholeStrategy(), merged=True)
    return model


def save_long_tailed_base(path: Path, logit: float = 4.0) -> str:
    """save_tiny_base's model with long-tailed response lengths (most short, a few at any cap, as reasoning policies
    have), for --partial_rollout: EOS's head row is set along the mean of the final hidden states over random tokens,
    so EOS scores about `logit` above its random level everywhere (on the demo prompts, seed 5, logit 4: a mean of
    ~37 tokens out of 96, median ~27, one in eight at the cap)."""
    from rlrun.models.tiny import EOS_ID, build_byte_tokenizer, build_causal_lm, tiny_model_config

    model = build_causal_lm(tiny_model_config(), seed=5)
    with torch.no_grad():
        ids = torch.randint(0, model.config.vocab_size, (16, 40), generator=torch.Generator().manual_seed(0))
        hidden = model.model(input_ids=ids).last_hidden_state.reshape(-1, model.config.hidden_size).mean(0)
        model.lm_head.weight[EOS_ID] = logit * hidden / hidden.norm() ** 2
    model.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return str(path)


def update_actor(actor, data, minibatches, kl_coef: float, budget=None) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """One actor update as the RL step runs it (rlrun.rl.trainer.Trainer.learn): the actor's loss through its update
    loop; the stats under actor/."""
    return update_actor_seen(actor, data, minibatches, kl_coef, budget)[0]


def update_actor_seen(actor, data, minibatches, kl_coef: float, budget=None):  # type: ignore[no-untyped-def]
    """update_actor, and what its loss saw (PolicyLoss.seen: [rows, 1 + R], on-policy updates only, else None)."""
    from rlrun.data.batching import RowLengths

    lengths = RowLengths.of(data.batch) if budget is not None else None
    loss = actor.loss(data, kl_coef, budget, len(minibatches))
    stats = actor.updater.run(minibatches, data.batch.action_mask, loss, budget, lengths)
    seen = loss.seen() if data.old_log_probs is None else None
    return {f"actor/{k}": v for k, v in stats.items()}, seen


def update_critic(critic, data, minibatches, budget=None) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """One critic update as the RL step runs it; the stats under critic/."""
    from rlrun.data.batching import RowLengths

    lengths = RowLengths.of(data.batch) if budget is not None else None
    stats = critic.updater.run(minibatches, data.batch.action_mask, critic.loss(data, budget), budget, lengths)
    return {f"critic/{k}": v for k, v in stats.items()}


def assert_close_to_scale(actual, expected, *, rtol: float = 1e-4, scale_tol: float = 1e-5, msg: str = "") -> None:  # type: ignore[no-untyped-def]
    """Gradients (or anything summed) computed in two orders: each element within `rtol` of its own value or within
    `scale_tol` of the tensor's scale (its largest magnitude). Float sums taken in another order (padded vs packed rows,
    other micro-batch splits, another CPU's vector width) differ by a few ulps of their largest terms, so an element far
    below the tensor's scale may miss any tolerance of its own while the tensor agrees to scale_tol (issue 45: one
    element in 2,048 of a gradient of scale 16 differed by 7.6e-6 on another machine)."""
    import torch

    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=scale_tol * scale, msg=msg or None)


# ---- a tiny native engine with sharp logits (the gateway and environment tests) ------------------------------------
SHARP_TEMPERATURE = 0.9
SHARP_CAP = 12  # most new tokens per call


def sharp_native_engine():  # type: ignore[no-untyped-def]  - a rlrun NativeEngine
    """rlrun's native engine on a tiny random Qwen2 over the byte tokenizer, its logits sharpened so log-probs are far
    from uniform (a wrong one shows)."""
    from transformers import Qwen2Config

    from rlrun.engines.native.engine import NativeEngine
    from rlrun.engines.protocol import SamplingSettings
    from rlrun.models.tiny import BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, build_byte_tokenizer, build_causal_lm

    cfg = Qwen2Config(vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      max_position_embeddings=256, pad_token_id=PAD_ID, eos_token_id=EOS_ID, num_attention_heads=4,
                      num_key_value_heads=2)
    model = build_causal_lm(cfg, seed=3).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(4.0)
    settings = SamplingSettings(SHARP_TEMPERATURE, 1.0, SHARP_CAP, PAD_ID, (EOS_ID,))
    return NativeEngine(model, settings, torch.device("cpu"), build_byte_tokenizer())


def hf_log_probs(model, temperature: float, prompt: list[int], response: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """log p(response token | prefix) under logits / temperature, from one HF forward of prompt + response."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


# ---- lanes: venvs of their own for packages that cannot share .venv (vLLM's CPU build, openenv) --------------------
def lane_skip(python: Path, package: str, name: str, installer: str, untested: str):  # type: ignore[no-untyped-def]
    """A skipif marker for the tests that need the lane venv at `python` with `package` installed, loud in the log
    when it is missing or broken (name: "vLLM"; installer: its scripts/ci script; untested: what goes untested)."""
    import pytest

    problem = None
    if not python.exists():
        problem = (f"!!! {name.upper()} LANE NOT INSTALLED: {python} is missing; run bash scripts/ci/{installer} (CI "
                   f"runs it from scripts/install.sh --test). {untested} UNTESTED in this run. !!!")
    else:
        probe = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version('{package}'))"],
                               capture_output=True, text=True, timeout=60)
        if probe.returncode != 0:
            problem = (f"!!! {name} LANE BROKEN: {python} has no {package} ({probe.stderr.strip()[-200:]}). "
                       "UNTESTED. !!!")
    if problem is not None:  # loud in the log, not only in -ra's summary
        print(f"\n{problem}\n", file=sys.stderr)
    return pytest.mark.skipif(problem is not None, reason=problem or "")


class ScriptedToolEngine:
    """Stand-in for a model (no tiny model writes a tool call, or only valid text, on cue). Reply n of an episode (n:
    the assistant turns its prompt holds, counted by the chat template's `turn` marker) is replies[n], or bad[n] when
    the prompt asks for "the bad tool"; log-probs -0.01, -0.02, ... per token. ChatML by default."""

    def __init__(self, tok, replies: list[str], bad: list[str], turn: str = "<|im_start|>assistant",  # type: ignore[no-untyped-def]
                 end: str = "<|im_end|>") -> None:
        from types import SimpleNamespace

        self.tok, self.replies, self.bad, self.turn = tok, replies, bad, turn
        self.sampling = SimpleNamespace(end_ids=(tok.convert_tokens_to_ids(end),))

    def sample(self, prompts, seed, *, max_new_tokens=None, stop=(), keys=None):  # type: ignore[no-untyped-def]
        from rlrun.engines.protocol import Generation

        out = []
        for p in prompts:
            text = self.tok.decode(p)
            script = self.bad if "the bad tool" in text else self.replies
            out.append(self.tok.encode(script[text.count(self.turn) - 1], add_special_tokens=False))
        return Generation(out, [[-0.01 * (j + 1) for j in range(len(r))] for r in out])
