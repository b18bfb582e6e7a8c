"""Issue 6, "never hang, never lose data": every way a run can go wrong, run for real.

Each table case launches rlrun (torchrun --standalone with 2 or 4 ranks, or `python -m rlrun.ppo` for one
rank) and checks that
  * the exit status is non-zero (2 for a config error of a single process),
  * EVERY process of the run is gone afterwards: torchrun's workers live in their own sessions, so the check
    looks for any process whose command line holds the case's unique directory (--save_path and every other
    path lie under it) and for every descendant pid seen while the run was alive; torchrun's summary must
    list every rank with a non-zero exit status,
  * it exits within a bound, measured from the start and from the first error line,
  * the message's key words appear, on the expected number of lines (one, where the design promises one).
Measured times go to /tmp/rlrun_failure_times.json and are printed as a table at the end of the module.

The table cases run JOBS at a time (RLRUN_FAILURE_JOBS, default 2) on a thread pool started by the first
table test; the hang test runs before it, alone, because its collective timeout is short.
"""

from __future__ import annotations

import ast
import http.server
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil
import pytest
import torch
from helpers import REPO, refusing_port

FIXTURES = REPO / "tests" / "fixtures"
TIMES_FILE = Path("/tmp/rlrun_failure_times.json")
JOBS = int(os.environ.get("RLRUN_FAILURE_JOBS", "2"))
TOTAL_BOUND_S = 120.0  # start to exit: startup on a loaded 2-core machine dominates
AFTER_ERROR_BOUND_S = 45.0  # first error line to exit: the real "does it hang" number
KILL_AFTER_S = 240.0  # a run still alive then is killed and the case fails
DIST_TIMEOUT = "20"
SECRET = "MYSECRETKEY123"
TOKEN = "tok-SECRET-9f8e7d"

ERROR_LINE = re.compile(r"^\[rlrun [\d:]+ error\] (.*)$", re.M)
INFO_LINE = re.compile(r"^\[rlrun [\d:]+ info\] (.*)$", re.M)
FAILED_LINE = re.compile(
    r"^\[rlrun [\d:]+ error\] rank (\d+): FAILED \(([^)]*)\) in phase (\w+)(?: at step (\d+))?: (.*)$", re.M)
# The first sign of a failure: an rlrun error line, or torchrun stopping workers (a SIGKILLed rank says nothing).
FIRST_FAILURE = re.compile(r"^\[rlrun [\d:]+ error\] |closing signal SIGTERM|failed \(exitcode: ")

# Small enough for seconds per step on CPU; 8 rollouts split over 1, 2 or 4 ranks.
SMALL = ["--config", "configs/demo.yaml", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2",
         "--train_batch_size", "8", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4",
         "--generate_max_len", "4", "--max_steps", "2", "--dist_timeout", DIST_TIMEOUT]
DEMO_RM = ["--remote_rm_url", "demo"]  # the demo's rule, named: data or a model of one's own needs a reward source
SPLIT = ["--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1"]  # 2 ranks: rank 0 actor, rank 1 engine

# ---- running one case ----------------------------------------------------------------------------------------

@dataclass
class Outcome:
    returncode: int
    output: str  # stdout + stderr, in arrival order
    seconds: float  # start to exit
    after_error_s: float | None  # first rlrun error line to exit
    leftovers: list[str]  # processes of this run still alive after it exited
    workdir: Path


def _command(nproc: int) -> list[str]:
    if nproc:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "--monitor-interval", "0.1", "-m", "rlrun.ppo"]
    return [sys.executable, "-m", "rlrun.ppo"]


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    """The test runner's environment without launcher, fault, token or wandb variables; offline and quiet."""
    env = {k: v for k, v in os.environ.items()
           if not re.match(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|MASTER_PORT|"
                           r"TORCHELASTIC_.*|SLURM_.*|RLRUN_FAULT|RLRUN_REWARD_TOKEN|WANDB_.*)$", k)}
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "RLRUN_NO_PROGRESS": "1", "DS_ACCELERATOR": "cpu",
                "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def _processes_with(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if any(marker in arg for arg in proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _alive(pids: dict[int, float]) -> list[psutil.Process]:
    out = []
    for pid, created in pids.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.NoSuchProcess:
            continue
    return out


def launch(nproc: int, args: list[str], workdir: Path, env: dict[str, str] | None = None) -> Outcome:
    """Run rlrun with --save_path WORKDIR/save unless given, wait, and account for every process."""
    cmd = _command(nproc) + args
    if "--save_path" not in args:
        cmd += ["--save_path", str(workdir / "save")]
    return launch_cmd(cmd, workdir, env)


def launch_cmd(cmd: list[str], workdir: Path, env: dict[str, str] | None = None) -> Outcome:
    workdir.mkdir(parents=True, exist_ok=True)
    marker = f"{workdir}{os.sep}"  # unique per case; every path the run is given lies under it
    assert any(marker in a for a in cmd), "every case needs the marker in its command line"
    lines: list[tuple[float, str]] = []
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=_clean_env(env or {}), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic(), line)) for line in proc.stdout],
                              daemon=True)
    reader.start()
    seen: dict[int, float] = {}  # every descendant pid seen while the run was alive -> its create time
    timed_out = False
    while proc.poll() is None:
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                seen.setdefault(child.pid, child.create_time())
        except psutil.NoSuchProcess:
            pass
        if time.monotonic() - start > KILL_AFTER_S:
            timed_out = True
            break
        time.sleep(0.1)
    if timed_out:
        for p in [psutil.Process(proc.pid)] + _alive(seen) + _processes_with(marker):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()
    seconds = time.monotonic() - start
    reader.join(timeout=10)
    # torchrun waits for its workers before it exits; give the kernel a moment to reap, then look.
    deadline = time.monotonic() + 5
    while (_processes_with(marker) or _alive(seen)) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = {p.pid: p for p in _processes_with(marker) + _alive(seen)}
    leftovers = []
    for p in survivors.values():
        try:
            leftovers.append(f"{p.pid} {' '.join(p.cmdline())[:200]}")
            p.kill()  # never leave them behind, even when the test fails
        except psutil.NoSuchProcess:
            continue
    output = "".join(line for _, line in lines)
    first_error = next((t for t, line in lines if FIRST_FAILURE.search(line)), None)
    after = (start + seconds - first_error) if first_error is not None else None
    if timed_out:
        output += f"\n[test] KILLED after {KILL_AFTER_S:.0f} s: the run hung\n"
    (workdir / "output.log").write_text(output)  # for a look after the fact
    return Outcome(proc.returncode, output, seconds, after, leftovers, workdir)


_times_lock = threading.Lock()
_measured: list[str] = []


def record_time(case_id: str, out: Outcome, nproc: int) -> None:
    with _times_lock:
        try:
            times = json.loads(TIMES_FILE.read_text())
        except (OSError, ValueError):
            times = {}
        times[case_id] = {"ranks": nproc or 1, "exit_s": round(out.seconds, 1),
                          "after_error_s": None if out.after_error_s is None else round(out.after_error_s, 1),
                          "rc": out.returncode, "jobs": JOBS, "recorded": time.strftime("%Y-%m-%d %H:%M:%S")}
        TIMES_FILE.write_text(json.dumps(times, indent=1, sort_keys=True))
    _measured.append(case_id)


@pytest.fixture(scope="module", autouse=True)
def times_table(request):
    """Print the measured time of every case run in this session when the module finishes."""
    yield
    if not _measured:
        return
    times = json.loads(TIMES_FILE.read_text())
    rows = [f"{'case':32} {'ranks':>5} {'rc':>4} {'exit s':>7} {'after error s':>14}"]
    for case_id in _measured:
        t = times[case_id]
        after = "-" if t["after_error_s"] is None else f"{t['after_error_s']:.1f}"
        rows.append(f"{case_id:32} {t['ranks']:>5} {t['rc']:>4} {t['exit_s']:>7.1f} {after:>14}")
    text = f"\nrlrun failure cases (JOBS={JOBS}; times in {TIMES_FILE}):\n" + "\n".join(rows)
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if capture is not None:
        with capture.global_and_fixture_disabled():
            print(text, flush=True)
    else:
        print(text)


def assert_ended(out: Outcome, *, success: bool = False) -> None:
    """Non-zero exit (unless a success is expected), nothing left running, within the bounds."""
    tail = out.output[-6000:]
    assert "[test] KILLED" not in out.output, tail
    assert not out.leftovers, f"processes survived the run: {out.leftovers}\n{tail}"
    if success:
        assert out.returncode == 0, tail
        return
    assert out.returncode != 0, tail
    assert out.seconds < TOTAL_BOUND_S, f"took {out.seconds:.1f} s\n{tail}"
    assert out.after_error_s is not None, f"no error line\n{tail}"
    assert out.after_error_s < AFTER_ERROR_BOUND_S, f"{out.after_error_s:.1f} s from the error to the exit\n{tail}"
    assert not re.search(r'File ".*[/\\]rlrun[/\\]', _without_stack_dumps(out.output)), \
        f"an rlrun traceback (expected one line per failure)\n{tail}"


def _without_stack_dumps(output: str) -> str:
    # faulthandler dumps ("Thread 0x...", "Current thread 0x...") are wanted for hangs; tracebacks are not.
    return re.sub(r"^(Thread|Current thread) 0x[0-9a-f]+ \(most recent call first\):\n(  File .*\n)+", "", output,
                  flags=re.M)


# ---- a local HTTP reward server -------------------------------------------------------------------------------

class _RewardHandler(http.server.BaseHTTPRequestHandler):
    seen_good_token = 0

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _reply(self, code: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802 - http.server's name
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["query"])
        path = self.path.split("?")[0]
        if path == "/slow":
            time.sleep(6)
            self._reply(200, json.dumps([0.0] * n).encode())
        elif path == "/nonjson":
            self._reply(200, b"<html>502 Bad Gateway from a proxy</html>", "text/html")
        elif path == "/short":
            self._reply(200, json.dumps({"rewards": [0.5] * (n - 1)}).encode())
        elif path == "/echo500":  # a server that echoes the credentials it got into its error page
            self._reply(500, f"internal error handling Authorization={self.headers.get('Authorization')}".encode(),
                        "text/plain")
        elif path == "/token":
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self._reply(401, b"missing or wrong bearer token", "text/plain")
                return
            type(self).seen_good_token += 1
            self._reply(200, json.dumps({"rewards": [0.25] * n}).encode())
        else:
            self._reply(404, b"no such path", "text/plain")


@pytest.fixture(scope="module")
def reward_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _RewardHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# ---- the harness itself ------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_harness_finds_and_kills_leftover_processes(tmp_path):
    """The leftover check is not vacuous: a process that outlives its launcher (own session, marker in argv) is
    reported, and killed."""
    # The orphan's output goes nowhere: holding the launcher's pipe would only make the harness wait out its reader.
    orphan = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', "
              f"{str(tmp_path / 'x')!r}], start_new_session=True, stdout=subprocess.DEVNULL, "
              "stderr=subprocess.DEVNULL)")
    out = launch_cmd([sys.executable, "-c", orphan, str(tmp_path / "x")], tmp_path)
    assert out.returncode == 0
    assert len(out.leftovers) == 1 and "time.sleep(60)" in out.leftovers[0]
    time.sleep(0.5)
    assert not _processes_with(f"{tmp_path}{os.sep}")


# ---- a hang where no bound of rlrun's reaches (a hung reward function has its own: tests/rl/test_checkpoint_safety) --

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hung_rank_is_dumped_and_everyone_exits(tmp_path):
    """Rank 1 never returns from its train phase (RLRUN_FAULT ...:hang); rank 0's collective times out
    (--dist_timeout 5), and the job ends within ~30 s with the hung rank's Python stack on stderr (dumped when
    the launcher stops it): the watchdog, the last resort."""
    args = SMALL[:-2] + ["--dist_timeout", "5"]
    out = launch(2, args, tmp_path, env={"RLRUN_FAULT": "train:0:1:hang"})
    record_time("hung_rank1", out, 2)
    assert_ended(out)
    assert out.after_error_s is not None and out.after_error_s < 30, out.output[-4000:]
    notes = [m for m in ERROR_LINE.findall(out.output) if "stopping" in m]
    assert len(notes) == 1 and notes[0].startswith("rank 0:"), out.output[-4000:]
    assert "a collective timed out after --dist_timeout 5 s" in notes[0]
    assert "hung" in notes[0]
    assert not FAILED_LINE.search(out.output)  # nobody failed by itself: rank 1 is stuck, not broken
    assert _rank_exitcodes(out.output) == {0: 1, 1: -15}, out.output[-3000:]  # rank 1 was stopped by torchrun
    dump = re.search(r"^Current thread 0x[0-9a-f]+ \(most recent call first\):\n((?:  File .*\n)+)", out.output, re.M)
    assert dump, f"no stack dump from the hung rank:\n{out.output[-4000:]}"
    assert 'File "' in dump.group(1) and "phases.py" in dump.group(1), dump.group(1)
    assert "in maybe_inject" in dump.group(1)


# ---- NaN gradients: the optimizer step is skipped, and too many in a row abort ---------------------------------

class _PlainClipper:
    def clip_grad_norm(self, model, max_norm):
        params = [p for p in model.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))


def _updater(max_in_a_row: int = 10):
    from rlrun.roles.update import Updater

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return Updater(model, _PlainClipper(), optimizer, scheduler, max_norm=1.0, micro_batch=4, dp_rank=0, dp_size=1,
                   max_nonfinite_in_a_row=max_in_a_row)


def _loss(model, poison: bool):
    x = torch.ones(4, 3)

    def micro_loss(rows, num_tokens, num_seqs):
        out = model(x[rows]).sum() / num_seqs
        if poison:
            out = out * float("nan")
        return out, {"loss": out.detach()}

    return micro_loss


def test_nan_gradient_skips_the_optimizer_step():
    u = _updater()
    before = {k: v.clone() for k, v in u.model.state_dict().items()}
    batch, mask = [torch.arange(4)], torch.ones(4, 2)
    stats = u.run(batch, mask, _loss(u.model, poison=True))
    assert u.skipped_steps == 1 and stats["skipped_steps"] == 1.0
    for k, v in u.model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed by a NaN step"
    assert all(p.grad is None for p in u.model.parameters())  # nothing left to leak into the next step
    assert not u.optimizer.state  # Adam's moments never saw the NaN
    stats = u.run(batch, mask, _loss(u.model, poison=False))
    assert u.skipped_steps == 1 and u.nonfinite_in_a_row == 0
    assert math.isfinite(stats["grad_norm"])
    assert any(not torch.equal(v, before[k]) for k, v in u.model.state_dict().items())  # a finite step does update


def test_too_many_nan_steps_in_a_row_abort():
    from rlrun.runtime.errors import RlrunError

    u = _updater(max_in_a_row=3)
    batch, mask = [torch.arange(4)], torch.ones(4, 2)
    u.run(batch, mask, _loss(u.model, poison=True))
    u.run(batch, mask, _loss(u.model, poison=False))  # a finite step resets the streak
    u.run(batch, mask, _loss(u.model, poison=True))
    u.run(batch, mask, _loss(u.model, poison=True))
    with pytest.raises(RlrunError, match=r"non-finite gradient for 3 optimizer steps in a row .*--max_skipped_steps"):
        u.run(batch, mask, _loss(u.model, poison=True))
    assert u.skipped_steps == 4


def test_max_skipped_steps_flag_reaches_the_updater():
    from rlrun.cli.parser import parse_args

    assert parse_args([]).config.train.max_skipped_steps == 10
    assert parse_args(["--max_skipped_steps", "3"]).config.train.max_skipped_steps == 3


# ---- safe loading ----------------------------------------------------------------------------------------------

def _sources() -> list[Path]:
    files = sorted((REPO / "src" / "rlrun").rglob("*.py"))
    assert len(files) > 10
    return files


def test_torch_load_always_weights_only():
    unsafe = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name != "load" or not (isinstance(func, ast.Attribute) and "torch" in ast.unparse(func.value)):
                continue
            weights_only = [k for k in node.keywords if k.arg == "weights_only"]
            value = weights_only[0].value if weights_only else None
            if not (isinstance(value, ast.Constant) and value.value is True):
                unsafe.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    assert not unsafe, "torch.load without weights_only=True:\n" + "\n".join(unsafe)


def test_no_pickle_anywhere():
    offenders = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            if any(n.split(".")[0] in ("pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib") for n in names):
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
        if re.search(r"__import__\(\s*['\"]pickle", path.read_text()):
            offenders.append(f"{path.relative_to(REPO)}: __import__('pickle')")
    assert not offenders, offenders


# ---- the table -------------------------------------------------------------------------------------------------

@dataclass
class Ctx:
    dir: Path
    url: str

    def file(self, name: str, text: str) -> str:
        path = self.dir / name
        path.write_text(text)
        return str(path)


@dataclass
class Case:
    id: str
    nproc: int  # 0: `python -m rlrun.ppo` (one process); else torchrun ranks
    args: Callable[[Ctx], list[str]]
    keys: list[str]  # key words, all on one error line
    lines: tuple[int, int] = (1, 1)  # how many error lines may carry keys[0] (min, max)
    rc: int | None = None  # exact exit status where it is defined (single process)
    env: Callable[[Ctx], dict[str, str]] = lambda ctx: {}
    failed: dict | None = None  # the FAILED line must match: rank, roles, phase, step
    success: bool = False  # not an error: the run must finish
    check: Callable[[Outcome, Ctx], None] | None = None


def _fx(name: str) -> str:
    return str(FIXTURES / name)


def _jsonl(ctx: Ctx, name: str, rows: list[dict]) -> str:
    return ctx.file(name, "".join(json.dumps(r) + "\n" for r in rows))


def _no_secret(out: Outcome, ctx: Ctx, secret: str) -> None:
    assert secret not in out.output, "the secret is in the console output"
    hits = []
    for path in ctx.dir.rglob("*"):
        if path.is_file() and secret.encode() in path.read_bytes():
            hits.append(str(path.relative_to(ctx.dir)))
    assert not hits, f"the secret was written to {hits}"


def _check_wandb_secret(out: Outcome, ctx: Ctx) -> None:
    complete = list((ctx.dir / "ckpt").glob("step_*/COMPLETE.json"))
    assert complete, out.output[-3000:]
    config = json.loads(complete[0].read_text())["meta"]["config"]
    assert config["logging"]["use_wandb"] == "<redacted>"
    assert list((ctx.dir / "wandb").rglob("*.wandb")), "wandb wrote no offline run"
    _no_secret(out, ctx, SECRET)


def _check_token_run(out: Outcome, ctx: Ctx) -> None:
    assert _RewardHandler.seen_good_token >= 1, "the server never got the bearer token"
    _no_secret(out, ctx, TOKEN)


def _check_token_echo(out: Outcome, ctx: Ctx) -> None:
    _no_secret(out, ctx, TOKEN)
    assert "<token>" in out.output  # the server's echo is in the message, scrubbed


def _prompts_line(out: Outcome) -> str:
    lines = [m for m in INFO_LINE.findall(out.output) if re.match(r"\d+ prompts \(", m)]
    assert len(lines) == 1, out.output[-3000:]
    return lines[0]


def _check_truncated(out: Outcome, ctx: Ctx) -> None:
    assert re.match(r"12 prompts \(5 truncated, 0 dropped at --prompt_max_len 64\)", _prompts_line(out)), out.output


def _check_dropped(out: Outcome, ctx: Ctx) -> None:
    assert re.match(r"7 prompts \(0 truncated, 5 dropped at --prompt_max_len 64\)", _prompts_line(out)), out.output


def _long_and_short(n_long: int, n_short: int) -> list[dict]:
    # "label" is what the built-in demo reward scores against.
    return ([{"input": f"Write digits: {i} " + "x" * 200, "label": "digits"} for i in range(n_long)]
            + [{"input": f"Write digits {i}:", "label": "digits"} for i in range(n_short)])


def _check_no_rank_dumped(out: Outcome, ctx: Ctx) -> None:
    assert "most recent call first" not in out.output, out.output[-4000:]


CASES: list[Case] = [
    # -- configuration and layout: one message from rank 0, exit status 2 ------------------------------------
    Case("unknown_flag", 2, lambda c: SMALL + ["--rollout_batchsize", "4"],
         ["unknown flag '--rollout_batchsize'", "did you mean '--rollout_batch_size'?"],
         check=lambda o, c: _assert_exitcodes(o, 2)),
    Case("yaml_mistyped_key", 0,
         lambda c: ["--config", c.file("bad.yaml", "train:\n  rollout_batchsize: 8\n")],
         ["rollout_batchsize", "rollout_batch_size"], rc=2),
    Case("negative_rollout_batch_size", 0, lambda c: SMALL + ["--rollout_batch_size", "-4"],
         ["--rollout_batch_size must be > 0", "-4"], rc=2),
    Case("eps_clip_zero", 0, lambda c: SMALL + ["--eps_clip", "0"], ["--eps_clip must be > 0"], rc=2),
    Case("top_p_two", 0, lambda c: SMALL + ["--top_p", "2"], ["--top_p must be in (0, 1]", "2.0"], rc=2),
    Case("remote_rm_timeout_zero", 0, lambda c: SMALL + ["--remote_rm_url", c.url + "/token", "--remote_rm_timeout", "0"],
         ["--remote_rm_timeout must be > 0"], rc=2),
    Case("batch_does_not_divide", 0, lambda c: SMALL + ["--train_batch_size", "3"],
         ["--train_batch_size 3 must divide the 8 rollouts per step"], rc=2),
    Case("layout_does_not_fit", 4,
         lambda c: SMALL + ["--init_kl_coef", "0.01", "--actor_num_gpus_per_node", "3", "--ref_num_gpus_per_node", "3"],
         ["world size 4", "actor 3", "ref 3"], check=lambda o, c: _assert_exitcodes(o, 2)),
    # The policy's config.json is read while parsing (it decides the generation backend): a configuration error.
    Case("missing_pretrain", 2, lambda c: SMALL + DEMO_RM + ["--pretrain", str(c.dir / "no_such_model")],
         ["error: --pretrain", "no_such_model", "no such file or directory, and not a Hugging Face Hub id"], check=lambda o, c: _assert_exitcodes(o, 2)),
    # -- files read before the first collective: every rank fails alike, rank 0 says it once -----------------
    Case("missing_prompt_data", 2, lambda c: SMALL + DEMO_RM + ["--prompt_data", str(c.dir / "nope.jsonl")],
         ["FAILED", "phase startup", "DataError", "nope.jsonl", "does not exist"]),
    Case("empty_dataset", 0, lambda c: SMALL + DEMO_RM + ["--prompt_data", c.file("empty.jsonl", "")],
         ["FAILED", "DataError", "empty.jsonl", "is empty"], rc=1),
    Case("missing_input_key", 2,
         lambda c: SMALL + DEMO_RM + ["--prompt_data", _jsonl(c, "q.jsonl", [{"question": "2+2?"}] * 8), "--input_key", "prompt"],
         ["FAILED", "DataError", "has no input_key 'prompt'", "['question']"]),
    Case("prompt_overflow_truncate", 0,
         lambda c: SMALL + DEMO_RM + ["--max_steps", "1", "--prompt_data", _jsonl(c, "p.jsonl", _long_and_short(5, 7)),
                            "--label_key", "label", "--prompt_overflow", "truncate"],
         [], success=True, check=_check_truncated),
    Case("prompt_overflow_drop", 0,
         lambda c: SMALL + DEMO_RM + ["--max_steps", "1", "--prompt_data", _jsonl(c, "p.jsonl", _long_and_short(5, 7)),
                            "--label_key", "label", "--prompt_overflow", "drop"],
         [], success=True, check=_check_dropped),
    Case("prompt_overflow_drop_all", 0,
         lambda c: SMALL + DEMO_RM + ["--prompt_data", _jsonl(c, "p.jsonl", _long_and_short(6, 2)), "--prompt_overflow", "drop"],
         ["FAILED", "6 of 8 prompts are longer than --prompt_max_len 64", "--rollout_batch_size 4"], rc=1),
    Case("reward_file_import_error", 2, lambda c: SMALL + ["--remote_rm_url", _fx("reward_import_error.py")],
         ["FAILED", "phase startup", "RewardError", "reward_import_error.py failed to import",
          "rlrun_no_such_module_for_tests"]),
    # -- reward function failures at run time ------------------------------------------------------------------
    Case("reward_file_raises", 2, lambda c: SMALL + SPLIT + ["--remote_rm_url", _fx("reward_raises.py")],
         ["FAILED", "ValueError: reward exploded on purpose", "reward_raises.py"],
         failed={"rank": 1, "roles": "engine", "phase": "generate", "step": 1}),
    Case("reward_file_wrong_length", 0, lambda c: SMALL + ["--remote_rm_url", _fx("reward_wrong_length.py")],
         ["FAILED", "has 7 values for 8 queries"], rc=1,
         failed={"rank": 0, "phase": "generate", "step": 1}),
    Case("reward_file_nan", 0, lambda c: SMALL + ["--remote_rm_url", _fx("reward_nan.py")],
         ["FAILED", "RewardError", "8 NaN/inf value(s)"], rc=1, failed={"rank": 0, "phase": "generate", "step": 1}),
    Case("reward_only_rank2_raises_step2", 4, lambda c: SMALL + ["--max_steps", "3", "--remote_rm_url",
                                                                  _fx("reward_rank2_step2.py")],
         ["FAILED", "RuntimeError: rank two reward broke on call 2"],
         failed={"rank": 2, "roles": "actor,engine", "phase": "generate", "step": 2}),
    # -- HTTP reward server ----------------------------------------------------------------------------------
    Case("reward_url_refused", 2,
         lambda c: SMALL + SPLIT + ["--remote_rm_url", f"http://127.0.0.1:{refusing_port()}/reward",
                                    "--remote_rm_retries", "2", "--remote_rm_timeout", "2"],
         ["FAILED", "failed after 2 attempts", "Connection refused"],
         failed={"rank": 1, "roles": "engine", "phase": "generate", "step": 1}),
    Case("reward_url_slow", 0,
         lambda c: SMALL + ["--remote_rm_url", c.url + "/slow", "--remote_rm_retries", "2", "--remote_rm_timeout", "1"],
         ["FAILED", "failed after 2 attempts", "timed out after 1 s"], rc=1),
    Case("reward_url_not_json", 0, lambda c: SMALL + ["--remote_rm_url", c.url + "/nonjson"],
         ["FAILED", "returned a non-JSON response", "502 Bad Gateway"], rc=1),
    Case("reward_url_wrong_length", 0, lambda c: SMALL + ["--remote_rm_url", c.url + "/short"],
         ["FAILED", "has 7 values for 8 queries"], rc=1),
    # -- outputs that cannot be written: fail at startup, not after hours of training ---------------------------
    Case("unwritable_save_path", 2,
         lambda c: SMALL + ["--save_path", str(Path(c.file("a_file", "x")) / "save")],
         ["FAILED", "phase startup", "--save_path", "a_file/save", "is not a writable directory"],
         failed={"rank": 0, "phase": "startup"}),
    Case("unwritable_ckpt_path", 2,
         lambda c: SMALL + ["--save_steps", "1", "--ckpt_path", str(Path(c.file("a_file", "x")) / "ckpt")],
         ["FAILED", "phase startup", "--ckpt_path", "a_file/ckpt", "is not a writable directory"],
         failed={"rank": 0, "phase": "startup"}),
    # -- a rank dies --------------------------------------------------------------------------------------------
    Case("rank1_sigkilled_in_train", 2, lambda c: SMALL + ["--max_steps", "3"],
         [], env=lambda c: {"RLRUN_FAULT": "train:1:1"}, check=lambda o, c: _assert_killed(o, 1)),
    # -- secrets ------------------------------------------------------------------------------------------------
    Case("wandb_key_not_written", 2,
         lambda c: SMALL + ["--max_steps", "1", "--save_steps", "1", "--ckpt_path", str(c.dir / "ckpt"),
                            "--use_wandb", SECRET],
         [], success=True, env=lambda c: {"WANDB_MODE": "offline", "WANDB_DIR": str(c.dir / "wandb"),
                                          "WANDB_SILENT": "true"},
         check=_check_wandb_secret),
    Case("reward_token_sent_not_shown", 0, lambda c: SMALL + ["--max_steps", "1", "--remote_rm_url", c.url + "/token"],
         [], success=True, env=lambda c: {"RLRUN_REWARD_TOKEN": TOKEN}, check=_check_token_run),
    Case("reward_token_echoed_by_server", 0,
         lambda c: SMALL + ["--remote_rm_url", c.url + "/echo500", "--remote_rm_retries", "1"],
         ["FAILED", "HTTP 500", "failed after 1 attempts"], rc=1, env=lambda c: {"RLRUN_REWARD_TOKEN": TOKEN},
         check=_check_token_echo),
]
CASE_BY_ID = {c.id: c for c in CASES}
assert len(CASE_BY_ID) == len(CASES)


def _assert_exitcodes(out: Outcome, code: int) -> None:
    # torchrun's summary lists each failed worker's own exit status.
    assert re.search(rf"exitcode\s*:\s*{code}\b", out.output), out.output[-3000:]


def _rank_exitcodes(output: str) -> dict[int, int]:
    """rank -> exit status from torchrun's failure summary (it lists every worker that did not exit 0)."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\n\s*exitcode\s*:\s*(-?\d+)", output)
    return {int(r): int(c) for r, c in found}


def _assert_killed(out: Outcome, rank: int) -> None:
    assert re.search(rf"rank\s*:\s*{rank} .*\n.*exitcode\s*:\s*-9", out.output), out.output[-3000:]
    assert not FAILED_LINE.search(out.output), "a SIGKILLed rank cannot report, and no other rank failed by itself"


def execute(case: Case, workdir: Path, url: str) -> tuple[Outcome, Ctx]:
    ctx = Ctx(workdir, url)
    workdir.mkdir(parents=True, exist_ok=True)
    return launch(case.nproc, case.args(ctx), workdir, case.env(ctx)), ctx


@pytest.fixture(scope="module")
def started(request, tmp_path_factory, reward_server):
    """Start every selected table case on a pool of JOBS workers; each test waits for its own."""
    wanted = [item.callspec.params["case_id"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec") and "case_id" in item.callspec.params]
    pool = ThreadPoolExecutor(max_workers=JOBS, thread_name_prefix="rlrun-case")
    futures: dict[str, Future] = {}
    for case_id in wanted:
        futures[case_id] = pool.submit(execute, CASE_BY_ID[case_id], tmp_path_factory.mktemp(case_id), reward_server)
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first one may wait for the pool to get to it
@pytest.mark.parametrize("case_id", [c.id for c in CASES])
def test_failure_case(case_id, started):
    case = CASE_BY_ID[case_id]
    out, ctx = started[case_id].result()
    record_time(case_id, out, case.nproc)
    assert_ended(out, success=case.success)
    if case.rc is not None:
        assert out.returncode == case.rc, out.output[-3000:]
    if case.keys:
        errors = ERROR_LINE.findall(out.output)
        carrying = [e for e in errors if case.keys[0] in e]
        low, high = case.lines
        assert low <= len(carrying) <= high, \
            f"{len(carrying)} error lines carry {case.keys[0]!r}:\n{out.output[-4000:]}"
        assert any(all(k in e for k in case.keys) for e in carrying), \
            f"no error line has all of {case.keys}:\n{out.output[-4000:]}"
        # The failing rank's one line is the only FAILED line: others only say that they stop.
        assert len(FAILED_LINE.findall(out.output)) <= high, out.output[-4000:]
    if case.failed is not None:
        (rank, roles, phase, step, _), = FAILED_LINE.findall(out.output)
        assert int(rank) == case.failed["rank"]
        assert phase == case.failed["phase"]
        if "roles" in case.failed:
            assert roles == case.failed["roles"]
        if "step" in case.failed:
            assert step and int(step) == case.failed["step"]
    if case.check is not None:
        case.check(out, ctx)
    if not case.success and case.nproc:
        _check_no_rank_dumped(out, ctx)  # only a hang dumps stacks
        codes = _rank_exitcodes(out.output)
        assert sorted(codes) == list(range(case.nproc)) and 0 not in codes.values(), \
            f"every rank must exit non-zero: {codes}\n{out.output[-3000:]}"


def test_a_finished_trainer_leaves_with_its_exit_handlers_run_and_no_finalization(tmp_path):
    """rlrun.ppo/sft/rm/dpo end through launch.failures.leave: atexit handlers (engines, worker pools, wandb) still
    run and the exit status is kept, but interpreter finalization does not (it tore down process groups that outlive
    destroy_process_group while their gloo threads ran, aborting a successful DeepSpeed rank now and then): an
    object whose finaliser would print is never finalised."""
    script = ("import atexit, sys, types\n"
              "sys.modules['deepspeed'] = types.ModuleType('deepspeed')  # a run that used DeepSpeed\n"
              "class Late:\n    def __del__(self):\n        print('finalized', flush=True)\n"
              "keep = Late()\n"
              "atexit.register(lambda: print('atexit ran', flush=True))\n"
              "from rlrun.launch.failures import leave\n"
              "print('done', end=' ')\n"
              "leave(3)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 3 and proc.stdout.split() == ["done", "atexit", "ran"], proc.stdout + proc.stderr
    plain = script.replace("sys.modules['deepspeed']", "unused")  # no DeepSpeed: a normal exit, finalization too
    proc = subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 3 and proc.stdout.split() == ["done", "atexit", "ran", "finalized"], proc.stdout
    for module in ("ppo", "sft", "rm", "dpo"):
        assert "    leave(main(" in (REPO / "src" / "rlrun" / f"{module}.py").read_text(), module
