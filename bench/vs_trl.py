"""rlrun vs TRL: the same GRPO job, timed step by step, in one invocation.

    .venv/bin/python bench/vs_trl.py                      # 2 rounds x 12 steps (installs TRL once)
    .venv/bin/python bench/vs_trl.py --rounds 1 --steps 3 # smoke test
    .venv/bin/python bench/vs_trl.py --skip-install       # fail instead of installing TRL

What it does:
  1. TRL lives in its own venv (bench/.venv-trl, gitignored), created on first use with
     `python3 -m venv` and installed with a constraints file pinning torch to rlrun's version (so
     pip never resolves a CUDA torch) and transformers to rlrun's version (so both run the same
     model code). rlrun's .venv is never touched.
  2. ONE workload is written to a work dir and used by both: a random-init Qwen2 (hidden 256,
     4 layers, ~3.1M parameters over rlrun's 259-token byte vocab), its tokenizer, 256 prompts
     (jsonl) and one reward file (fraction of lowercase letters in the completion) with rlrun's
     reward_func(queries, prompts, labels) and TRL's reward_funcs signature.
  3. Round-robin, --rounds times: TRL's GRPOTrainer (bench/vs_trl_runner.py in the TRL venv),
     rlrun on 1 rank, rlrun on 2 ranks (torchrun). Each is one subprocess tree with
     --threads CPU threads in all (2 ranks: threads/2 each), on the settings of `Workload`.
  4. Per system: the median s/step over steps WARMUP_STEPS+1..N of each round, the median of each
     phase (generate, score, train, sync), the peak RSS (sum over the process tree, sampled every
     0.2 s, and the largest single process from wait4), and TRL's median over rlrun's.
     Writes <out>/vs_trl.json and, when the TRL venv has matplotlib, <out>/vs_trl.png.

Timing sources: rlrun's metrics.jsonl (time/step, time/generate, time/score, time/train,
time/sync); TRL's per-step callback written by vs_trl_runner.py (same phase split, see there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
DEFAULT_VENV = BENCH / ".venv-trl"
DEFAULT_OUT = BENCH / "results"
TRL_VERSION = "1.16.0"
WARMUP_STEPS = 2  # steps 1..2 pay one-off costs (allocator, first generate); medians use 3..N
PHASES: tuple[str, ...] = ("generate", "score", "train", "sync")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false", "RLRUN_NO_PROGRESS": "1", "WANDB_MODE": "disabled"}


# ---- the workload ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """The one set of settings both trainers get (translated by rlrun_args / trl_config)."""

    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    max_new_tokens: int = 64
    prompt_max_len: int = 64
    temperature: float = 1.0
    kl_coef: float = 0.04  # k3 KL as a loss term (GRPO)
    clip_eps: float = 0.2
    learning_rate: float = 1e-5
    adam_betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0
    seed: int = 42
    num_prompts: int = 256
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    micro_batch: int = 0  # rows per micro-batch, training and scoring; 0 = all of a step's rollouts in one
    bf16: bool = False  # bf16 mixed precision in both (TRL: its default bf16=True over fp32 weights; rlrun: --bf16)
    device: Literal["cpu", "cuda"] = "cpu"

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt


@dataclass(frozen=True)
class System:
    name: str
    kind: Literal["trl", "rlrun"]
    nproc: int
    flags: tuple[str, ...] = ()  # rlrun layout/loop flags on top of the workload's
    actor_ranks: int = 0  # data-parallel width of the actor; 0 = every rank

    @property
    def slug(self) -> str:
        return "_".join(self.name.lower().split())

    @property
    def data_parallel(self) -> int:
        return self.actor_ranks or self.nproc


# rlrun generates with its native engine (the default for this Qwen2); the "hf" row generates with transformers
# `generate`, as TRL does. The async row: actor on rank 0, one engine on rank 1 generating step N+1 while the
# actor trains on step N (one step off-policy; rlrun's --async_train). TRL has no such mode without vLLM.
SYSTEMS: tuple[System, ...] = (
    System("TRL", "trl", 1), System("rlrun 1 rank", "rlrun", 1),
    System("rlrun 1 rank hf", "rlrun", 1, ("--generation_backend", "hf")), System("rlrun 2 ranks", "rlrun", 2),
    System("rlrun 2 ranks async", "rlrun", 2,
           ("--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1", "--async_train"), actor_ranks=1),
)


def model_config(wl: Workload) -> Any:
    """Qwen2 over rlrun's byte vocab (~3.1M parameters at the defaults)."""
    from transformers import Qwen2Config

    from rlrun.models.tiny import BOS_ID, BYTE_VOCAB_SIZE, EOS_ID, PAD_ID

    return Qwen2Config(vocab_size=BYTE_VOCAB_SIZE, hidden_size=wl.hidden_size, intermediate_size=wl.intermediate_size,
                       num_hidden_layers=wl.num_layers, num_attention_heads=wl.num_heads,
                       num_key_value_heads=wl.num_kv_heads, max_position_embeddings=512, tie_word_embeddings=False,
                       pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)


def make_prompts(n: int) -> list[dict[str, str]]:
    """n distinct short plain-text prompts (deterministic), cycling through 8 x 4 x 8 phrasings."""
    verbs = ["Write", "Type", "Print", "Give me", "List", "Say", "Output", "Show"]
    amounts = ["some", "a few", "many", "ten"]
    things = ["words", "letters", "names", "colours", "animals", "fruits", "cities", "verbs"]
    out = []
    for i in range(n):
        verb, amount, thing = verbs[i % 8], amounts[(i // 8) % 4], things[(i // 32) % 8]
        suffix = "" if i < 256 else f" #{i // 256}"
        out.append({"prompt": f"{verb} {amount} {thing}{suffix}:"})
    return out


@dataclass(frozen=True)
class WorkFiles:
    """What both trainers load, written once by build_workdir."""

    model_dir: str  # model + tokenizer (save_pretrained)
    prompts_file: str  # jsonl, one {"prompt": ...} per line
    reward_file: str  # copy of vs_trl_reward.py
    num_params: int


def build_workdir(work: Path, wl: Workload) -> WorkFiles:
    """Save the model, tokenizer, prompts and reward file both trainers load."""
    from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm

    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    tokenizer = build_byte_tokenizer()
    model = build_causal_lm(model_config(wl), seed=wl.seed)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return write_job_files(work, wl, model_dir, sum(p.numel() for p in model.parameters()))


def write_job_files(work: Path, wl: Workload, model_dir: Path, num_params: int) -> WorkFiles:
    """The prompts and reward file beside a saved model folder (bench/gpu/harness.py brings its own models)."""
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in make_prompts(wl.num_prompts)))
    reward = work / "reward.py"
    shutil.copyfile(BENCH / "vs_trl_reward.py", reward)
    return WorkFiles(str(model_dir), str(prompts), str(reward), num_params)


def rlrun_args(wl: Workload, files: WorkFiles, system: System, steps: int, run_dir: Path) -> list[str]:
    """rlrun.ppo flags for the workload: GRPO (group_norm), k3 KL loss (none at kl_coef 0), one optimizer step per
    rollout."""
    batch, nproc = wl.rollouts_per_step, system.data_parallel
    micro = (wl.micro_batch or batch) // nproc
    kl = ("--use_kl_loss", "--kl_estimator", "k3", "--init_kl_coef", str(wl.kl_coef)) if wl.kl_coef else (
        "--init_kl_coef", "0")
    return [
        "--pretrain", files.model_dir, "--prompt_data", files.prompts_file, "--input_key", "prompt",
        "--remote_rm_url", files.reward_file, "--advantage_estimator", "group_norm",
        *kl, "--eps_clip", str(wl.clip_eps),
        "--rollout_batch_size", str(wl.prompts_per_step), "--n_samples_per_prompt", str(wl.samples_per_prompt),
        "--train_batch_size", str(batch), "--micro_train_batch_size", str(micro),
        "--micro_rollout_batch_size", str(micro), "--max_epochs", "1",
        "--generate_max_len", str(wl.max_new_tokens), "--prompt_max_len", str(wl.prompt_max_len),
        "--temperature", str(wl.temperature), "--top_p", "1.0",
        "--actor_learning_rate", str(wl.learning_rate), "--lr_warmup_ratio", "0",
        "--adam_betas", str(wl.adam_betas[0]), str(wl.adam_betas[1]), "--max_norm", str(wl.max_grad_norm), "--l2", "0",
        "--num_episodes", str(max(1, -(-steps * wl.prompts_per_step // wl.num_prompts))), "--max_steps", str(steps),
        "--seed", str(wl.seed), "--device", wl.device, *(("--bf16",) if wl.bf16 else ()),
        "--save_path", str(run_dir / "model"), "--metrics_file", str(run_dir / "metrics.jsonl"), *system.flags,
    ]


def trl_config(wl: Workload, steps: int, run_dir: Path) -> dict[str, Any]:
    """GRPOConfig kwargs for the same job: all of a step's completions generated at once, ONE optimizer step on them."""
    micro = wl.micro_batch or wl.rollouts_per_step
    return {
        "output_dir": str(run_dir / "trl_out"),
        # rollouts = 1 process x micro per device x accumulation steps; generation_batch_size and steps_per_generation
        # then default to the rollouts and the accumulation steps: one generation, one optimizer step.
        "per_device_train_batch_size": micro, "gradient_accumulation_steps": wl.rollouts_per_step // micro,
        "num_generations": wl.samples_per_prompt, "num_iterations": 1,
        "max_completion_length": wl.max_new_tokens, "temperature": wl.temperature, "top_p": 1.0, "top_k": 0,
        "beta": wl.kl_coef, "epsilon": wl.clip_eps, "scale_rewards": "group",
        "loss_type": "dapo",  # token mean over the whole batch = rlrun's token-mean with one micro-batch
        "mask_truncated_completions": False,
        "learning_rate": wl.learning_rate, "lr_scheduler_type": "cosine", "warmup_steps": 0,
        "adam_beta1": wl.adam_betas[0], "adam_beta2": wl.adam_betas[1], "weight_decay": 0.0,
        "max_grad_norm": wl.max_grad_norm,
        "bf16": wl.bf16, "fp16": False, "use_cpu": wl.device == "cpu", "gradient_checkpointing": False,
        "model_init_kwargs": {"dtype": "float32"},  # TRL's own default for a model path: fp32 weights (bf16 autocast)
        "max_steps": steps, "seed": wl.seed, "logging_steps": 1, "save_strategy": "no", "report_to": "none",
        "disable_tqdm": True, "dataloader_num_workers": 0, "log_completions": False,
    }


# ---- the TRL venv ------------------------------------------------------------------------------


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def trl_versions(python: Path) -> dict[str, str] | None:
    """Versions of trl/transformers/torch in the venv, or None when trl is not importable there."""
    if not python.exists():
        return None
    code = ("import json, torch, transformers, trl; print(json.dumps({'trl': trl.__version__, "
            "'transformers': transformers.__version__, 'torch': torch.__version__}))")
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=child_env({}))
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def ensure_trl_venv(venv: Path, skip_install: bool) -> tuple[dict[str, str], float]:
    """(versions, install seconds; 0 when it was already there). Pins torch and transformers to rlrun's."""
    versions = trl_versions(venv_python(venv))
    if versions is not None:
        want = {"trl": TRL_VERSION, "transformers": metadata.version("transformers"), "torch": metadata.version("torch")}
        if versions != want:
            print(f"warning: {venv} holds {versions}, not {want}: the comparison is of other versions "
                  f"(delete {venv} to reinstall)", file=sys.stderr)
        return versions, 0.0
    if skip_install:
        raise SystemExit(f"error: no TRL in {venv} and --skip-install was given; run once without --skip-install "
                         f"(creates the venv, ~1-3 min) or pass --venv DIR of a venv with trl installed.")
    torch_version = metadata.version("torch").split("+")[0]
    transformers_version = metadata.version("transformers")
    start = time.perf_counter()
    print(f"installing TRL {TRL_VERSION} into {venv} (torch {torch_version}, transformers {transformers_version}) ...",
          flush=True)
    base_python = getattr(sys, "_base_executable", None) or shutil.which("python3") or "python3"
    subprocess.run([base_python, "-m", "venv", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={torch_version}\ntransformers=={transformers_version}\n")
    pip = [str(venv_python(venv)), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    for packages in ([f"torch=={torch_version}"],  # first and alone: the CPU wheel, never a CUDA one
                     [f"trl=={TRL_VERSION}", f"transformers=={transformers_version}", "matplotlib"]):
        proc = subprocess.run([*pip, "-c", str(constraints), *packages], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"error: pip install {' '.join(packages)} into {venv} failed:\n{proc.stderr[-3000:]}")
    seconds = time.perf_counter() - start
    versions = trl_versions(venv_python(venv))
    if versions is None:
        raise SystemExit(f"error: installed TRL into {venv} but `import trl` fails there; delete {venv} and retry.")
    print(f"TRL venv ready in {seconds:.0f} s: {versions}", flush=True)
    return versions, seconds


# ---- running and measuring ---------------------------------------------------------------------


def child_env(extra: dict[str, str]) -> dict[str, str]:
    """The environment of a measured subprocess: offline, no inherited venv or Python path (unless `extra` sets
    one: bench/gpu/harness.py's runs find rlrun and the carried wheels through PYTHONPATH)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(OFFLINE_ENV)
    env.update(extra)
    return env


@dataclass
class Measured:
    returncode: int
    wall_s: float
    peak_rss_tree_mib: float  # largest sum of RSS over the process tree, sampled
    peak_rss_proc_mib: float  # largest single process (wait4's ru_maxrss over the tree)


class TreeRss(threading.Thread):
    """Samples the summed RSS of a process and all its descendants until stopped."""

    def __init__(self, pid: int, interval_s: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval_s, self.peak_bytes = pid, interval_s, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self._stop_event.is_set():
            total = 0
            try:
                for proc in [root, *root.children(recursive=True)]:
                    try:
                        total += proc.memory_info().rss
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        pass
            except psutil.NoSuchProcess:
                return
            self.peak_bytes = max(self.peak_bytes, total)
            self._stop_event.wait(self.interval_s)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def run_measured(cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> Measured:
    """Run cmd in its own session; kill the session after timeout_s. Output goes to log_path."""
    with log_path.open("w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        sampler = TreeRss(proc.pid)
        sampler.start()
        timer = threading.Timer(timeout_s, lambda: os.killpg(proc.pid, signal.SIGKILL))
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
            sampler.stop()
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    return Measured(proc.returncode, time.perf_counter() - start, sampler.peak_bytes / 2**20, usage.ru_maxrss / 1024)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rlrun_steps(metrics_file: Path) -> list[dict[str, float]]:
    """Per step: step, time/step, time/<phase>, response_length, reward (from rlrun's metrics.jsonl)."""
    keys = ("step", "time/step", *(f"time/{p}" for p in PHASES), "time/engine_generate", "response_length", "reward")
    rows = [{k: float(r[k]) for k in keys if k in r} for r in read_jsonl(metrics_file)]
    for row, record in zip(rows, read_jsonl(metrics_file)):
        if "time/generate" not in row and "time/wait_rollout" in record:
            # --async_train: the engine generated during the previous step; the step only waited for it
            row["time/generate"] = float(record["time/wait_rollout"])
    return rows


def trl_steps(steps_file: Path) -> list[dict[str, float]]:
    """Per step: the runner's timing record merged with TRL's log of that step (length, reward)."""
    records = read_jsonl(steps_file)
    logs: dict[int, dict[str, Any]] = {}
    for r in records:  # the last step also gets train_runtime etc. in a record of its own
        if r.get("kind") == "log":
            logs.setdefault(int(r["step"]), {}).update(r)
    out = []
    for r in records:
        if r.get("kind") != "step":
            continue
        row = {k: float(v) for k, v in r.items() if k != "kind"}
        log = logs.get(int(r["step"]), {})
        if "completions/mean_length" in log:
            row["response_length"] = float(log["completions/mean_length"])
        if "reward" in log:
            row["reward"] = float(log["reward"])
        out.append(row)
    return out


def summarize(steps: list[dict[str, float]], warmup: int = WARMUP_STEPS) -> dict[str, float | int | None]:
    """Medians over the steps after the warm-up ones (all steps when there are no others)."""
    kept = [s for s in steps if s["step"] > warmup] or steps
    out: dict[str, float | int | None] = {"steps_used": len(kept)}
    for key in ("time/step", *(f"time/{p}" for p in PHASES), "time/engine_generate", "response_length"):
        values = [s[key] for s in kept if key in s]
        out[key] = statistics.median(values) if values else None
    return out


def run_system(system: System, wl: Workload, files: WorkFiles, steps: int, run_dir: Path, threads: int,
               trl_python: Path, timeout_s: float, python_path: str = "") -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "log.txt"
    path = {"PYTHONPATH": python_path} if python_path else {}
    if system.kind == "trl":
        spec = {"model_dir": files.model_dir, "prompts_file": files.prompts_file, "reward_file": files.reward_file,
                "steps_file": str(run_dir / "steps.jsonl"), "threads": threads,
                "grpo_config": trl_config(wl, steps, run_dir)}
        (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
        cmd = [str(trl_python), str(BENCH / "vs_trl_runner.py"), str(run_dir / "spec.json")]
        env = child_env({"OMP_NUM_THREADS": str(threads), **path})
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(system.nproc),
               "-m", "rlrun.ppo", *rlrun_args(wl, files, system, steps, run_dir)]
        env = child_env({"OMP_NUM_THREADS": str(max(1, threads // system.nproc)), **path})
    measured = run_measured(cmd, env, log, timeout_s)
    per_step = trl_steps(run_dir / "steps.jsonl") if system.kind == "trl" else rlrun_steps(run_dir / "metrics.jsonl")
    result = {"system": system.name, **dataclasses.asdict(measured), "steps": per_step,
              "summary": summarize(per_step), "log": str(log)}
    if measured.returncode != 0 or len(per_step) < steps:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise SystemExit(f"error: {system.name} exited {measured.returncode} with {len(per_step)}/{steps} steps "
                         f"logged; last lines of {log}:\n{tail}")
    return result


# ---- reporting ---------------------------------------------------------------------------------


def aggregate(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system: per-round medians, the median over rounds, phase medians, peak RSS, TRL's ratio."""
    out: dict[str, dict[str, Any]] = {}
    for system in SYSTEMS:
        mine = [r for r in runs if r["system"] == system.name]
        if not mine:
            continue
        per_round = [r["summary"]["time/step"] for r in mine]
        phases = {p: statistics.median([r["summary"][f"time/{p}"] or 0.0 for r in mine]) for p in PHASES}
        overlapped = [r["summary"].get("time/engine_generate") for r in mine]
        if all(x is not None for x in overlapped):  # generation off the step's critical path (--async_train)
            phases["generate_overlapped"] = statistics.median(overlapped)
        out[system.name] = {
            "per_round_s_per_step": per_round, "median_s_per_step": statistics.median(per_round), "phases_s": phases,
            "response_length": statistics.median([r["summary"]["response_length"] or 0.0 for r in mine]),
            "peak_rss_tree_mib": max(r["peak_rss_tree_mib"] for r in mine),
            "peak_rss_proc_mib": max(r["peak_rss_proc_mib"] for r in mine),
        }
    trl = out.get("TRL")
    for name, row in out.items():
        row["trl_over_this"] = trl["median_s_per_step"] / row["median_s_per_step"] if trl else None
    return out


def format_table(summary: dict[str, dict[str, Any]]) -> str:
    head = (f"{'system':<20} {'s/step per round':<22} {'median':>7} {'generate':>9} {'score':>7} {'train':>7} "
            f"{'sync':>6} {'resp len':>8} {'RSS tree MiB':>12} {'RSS proc MiB':>12} {'TRL/this':>8}")
    lines = [head, "-" * len(head)]
    for name, row in summary.items():
        rounds = " ".join(f"{x:.3f}" for x in row["per_round_s_per_step"])
        ph = row["phases_s"]
        ratio = f"{row['trl_over_this']:>8.2f}" if row["trl_over_this"] is not None else f"{'-':>8}"
        lines.append(f"{name:<20} {rounds:<22} {row['median_s_per_step']:>7.3f} {ph['generate']:>9.3f} "
                     f"{ph['score']:>7.3f} {ph['train']:>7.3f} {ph['sync']:>6.3f} {row['response_length']:>8.1f} "
                     f"{row['peak_rss_tree_mib']:>12.0f} {row['peak_rss_proc_mib']:>12.0f} {ratio}")
    overlapped = {name: row["phases_s"]["generate_overlapped"] for name, row in summary.items()
                  if "generate_overlapped" in row["phases_s"]}
    for name, seconds in overlapped.items():
        lines.append(f"{name}: generate = the wait for the engine; the engine's own generate ({seconds:.3f} s) "
                     "overlapped the previous step's training")
    return "\n".join(lines)


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="round-robin rounds of every system")
    parser.add_argument("--steps", type=int, default=12, help=f"steps per run (medians use steps {WARMUP_STEPS + 1}..N)")
    parser.add_argument("--skip-install", action="store_true", help="fail instead of creating the TRL venv")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where vs_trl.json and vs_trl.png go")
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="the TRL venv (created when missing)")
    parser.add_argument("--work", type=Path, default=None, help="keep the model, prompts and run logs here "
                        "(default: a temporary directory, deleted afterwards)")
    parser.add_argument("--threads", type=int, default=2,
                        help="CPU threads per system (2 ranks: threads/2 each, at least 1)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before one run is killed")
    parser.add_argument("--systems", default=",".join(s.slug for s in SYSTEMS),
                        help="comma-separated systems to run (default all: %(default)s)")
    args = parser.parse_args(argv)
    by_slug = {s.slug: s for s in SYSTEMS}
    unknown = [name for name in args.systems.split(",") if name not in by_slug]
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {sorted(by_slug)}")
    systems = [by_slug[name] for name in args.systems.split(",")]
    if args.rounds < 1 or args.steps < 1 or args.threads < 1:
        parser.error("--rounds, --steps and --threads must be >= 1")
    if args.steps <= WARMUP_STEPS:
        print(f"note: --steps {args.steps} <= {WARMUP_STEPS} warm-up steps: medians include warm-up (smoke only)")

    wl = Workload()
    versions, install_s = ensure_trl_venv(args.venv, args.skip_install)
    load = load_average()
    if load is not None and load[0] > 0.5 * (os.cpu_count() or 1):
        # Two OpenMP threads per process on a contended box run many times slower (threads spin at
        # barriers): such timings say nothing about either trainer.
        print(f"warning: load average {load[0]} on {os.cpu_count()} CPUs: timings will not be comparable; "
              f"run on an idle machine", file=sys.stderr)
    work = args.work or Path(tempfile.mkdtemp(prefix="rlrun-vs-trl-"))
    finished = False
    try:
        files = build_workdir(work, wl)
        print(f"workload: {files.num_params} parameters, {wl.rollouts_per_step} completions x "
              f"{wl.max_new_tokens} new tokens per step, {args.steps} steps x {args.rounds} rounds; work dir {work}",
              flush=True)
        load_before = load
        runs = []
        for round_ in range(args.rounds):
            for system in systems:
                run_dir = work / f"r{round_}_{system.slug}"
                result = run_system(system, wl, files, args.steps, run_dir, args.threads, venv_python(args.venv),
                                    args.timeout)
                runs.append({"round": round_, **result})
                s = result["summary"]
                print(f"round {round_ + 1}/{args.rounds} {system.name:<20} {s['time/step']:.3f} s/step "
                      f"(median of {s['steps_used']}), wall {result['wall_s']:.1f} s, "
                      f"peak RSS {result['peak_rss_tree_mib']:.0f} MiB", flush=True)
        summary = aggregate(runs)
        table = format_table(summary)
        print()
        print(table)
        print("generate includes the reward function for both; TRL's sync is 0 (no vLLM, generates in place).")
        args.out.mkdir(parents=True, exist_ok=True)
        report = {
            "smoke": args.steps <= WARMUP_STEPS + 2 or args.rounds < 2,
            "args": {"rounds": args.rounds, "steps": args.steps, "threads": args.threads},
            "warmup_steps_excluded": WARMUP_STEPS,
            "workload": {**dataclasses.asdict(wl), "num_params": files.num_params},
            "versions": {**versions, "rlrun_torch": metadata.version("torch"),
                         "rlrun_transformers": metadata.version("transformers")},
            "trl_install_s": install_s,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_before": load_before,
                        "load_after": load_average()},
            "trl_grpo_config": trl_config(wl, args.steps, Path("<run_dir>")),
            "rlrun_args": {s.name: rlrun_args(wl, WorkFiles("<model>", "<prompts>", "<reward>", files.num_params), s,
                                              args.steps, Path("<run_dir>"))
                           for s in systems if s.kind == "rlrun"},
            "summary": summary,
            "table": table,
            "runs": [{k: v for k, v in r.items() if k != "log"} for r in runs],
        }
        json_path = args.out / "vs_trl.json"
        json_path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {json_path}")
        png = args.out / "vs_trl.png"
        plot = subprocess.run([str(venv_python(args.venv)), str(BENCH / "vs_trl_plot.py"), str(json_path), str(png)],
                              env=child_env({}), capture_output=True, text=True)
        print(f"wrote {png}" if plot.returncode == 0 else f"no plot: {plot.stderr.strip().splitlines()[-1:]}")
        finished = True
    finally:
        if args.work is None and finished:
            shutil.rmtree(work, ignore_errors=True)
        elif not finished:
            print(f"run logs kept in {work}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
