"""Checkpoint benchmark on CPU: size, save time and load time of a resumable checkpoint, and the
time an elastic restart takes from a SIGKILL to the resumed run.

For each model (--models: the demo's tiny model and the ~100M preset) and world size (--worlds) it
runs rlrun twice under torchrun (gloo, CPU), with a tiny batch so that the checkpoint dominates:
  save   --max_steps 1 --save_steps 1: reads "checkpoint saved: PATH (MB MB in S s)" (rank 0's time
         from entering the save to the published checkpoint: DCP shards of the actor's weights and
         Adam state, trainer state, fsync, manifest, rename);
  load   the same command with --load_checkpoint: reads "resumed from PATH at step 1 (S s)" (rank 0's
         time from looking for the checkpoint to every rank holding the restored state);
then, for --restart_models, a torchrun --max-restarts 1 run that saves after step 1 and SIGKILLs rank 1
(RLRUN_FAULT=train:1:1) at the start of step 2's train phase. The restart time is measured from the
moment the killed process disappears (polled every 10 ms with psutil) to the moment the "resumed
from" line arrives on the launcher's output, and split into detect (kill -> torchrun reports the
failure), respawn (-> the new group's first log line: imports, data) and the rest (process groups,
model build, checkpoint load).

    python bench/checkpoint_bench.py                       # tiny + 100m, worlds 1 and 2, restart for tiny
    python bench/checkpoint_bench.py --models tiny --worlds 2 --restart_models tiny,100m --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY_BATCH = ["--rollout_batch_size", "2", "--n_samples_per_prompt", "2", "--train_batch_size", "4",
              "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "2", "--generate_max_len", "8"]
SAVED = re.compile(r"checkpoint saved: (\S+) \(([\d.]+) MB in ([\d.]+) s, checksums ([\d.]+) s\)")
RESUMED = re.compile(r"resumed from (\S+) at step (\d+) \(([\d.]+) s, checksums verified in ([\d.]+) s\)")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "RLRUN_NO_PROGRESS": "1", "DS_ACCELERATOR": "cpu",
                "PYTHONUNBUFFERED": "1"})
    env.pop("RLRUN_FAULT", None)
    env.update(extra)
    return env


def _cmd(nproc: int, model: str, workdir: Path, extra: list[str], max_restarts: int = 0) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            f"--max-restarts={max_restarts}", "-m", "rlrun.ppo", "--config", "configs/demo.yaml",
            "--model_preset", model, *TINY_BATCH, "--dist_timeout", "120",
            "--save_path", str(workdir), "--ckpt_path", str(workdir / "ckpt"), *extra]


def _run(cmd: list[str], timeout: float) -> str:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{out[-3000:]}")
    return out


def save_and_load(model: str, nproc: int, root: Path, timeout: float) -> dict:
    workdir = root / f"{model}_w{nproc}"
    args = ["--max_steps", "1", "--save_steps", "1"]
    t0 = time.monotonic()
    out = _run(_cmd(nproc, model, workdir, args), timeout)
    save_run_s = time.monotonic() - t0
    saved = SAVED.search(out)
    if not saved:
        raise SystemExit(f"no 'checkpoint saved' line:\n{out[-3000:]}")
    files = [p for p in Path(saved.group(1)).rglob("*") if p.is_file()]
    t0 = time.monotonic()
    out = _run(_cmd(nproc, model, workdir, args + ["--load_checkpoint"]), timeout)  # loads, then has nothing to do
    load_run_s = time.monotonic() - t0
    resumed = RESUMED.search(out)
    if not resumed:
        raise SystemExit(f"no 'resumed from' line:\n{out[-3000:]}")
    shutil.rmtree(workdir, ignore_errors=True)
    return {"model": model, "world": nproc, "size_mb": float(saved.group(2)), "files": len(files),
            "save_s": float(saved.group(3)), "load_s": float(resumed.group(3)),
            "checksum_save_s": float(saved.group(4)), "checksum_load_s": float(resumed.group(4)),
            "save_run_wall_s": round(save_run_s, 1), "load_run_wall_s": round(load_run_s, 1)}


def restart(model: str, root: Path, timeout: float) -> dict:
    """2 ranks, torchrun --max-restarts 1; rank 1 SIGKILLs itself in step 2's train phase."""
    import psutil

    workdir = root / f"{model}_restart"
    cmd = _cmd(2, model, workdir, ["--max_steps", "2", "--save_steps", "1", "--load_checkpoint"], max_restarts=1)
    t_start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(RLRUN_FAULT="train:1:1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic(), line))

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    agent = psutil.Process(proc.pid)
    victim = None
    killed = None
    deadline = time.monotonic() + timeout
    # The victim: the first attempt's worker with LOCAL_RANK 1; it is gone when it is gone or a zombie.
    while killed is None and time.monotonic() < deadline and proc.poll() is None:
        if victim is None:
            for child in agent.children(recursive=True):
                try:
                    env = child.environ()
                except (psutil.Error, OSError):
                    continue
                if env.get("LOCAL_RANK") == "1" and env.get("TORCHELASTIC_RESTART_COUNT") == "0":
                    victim = child
                    break
        else:
            try:
                gone = not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                killed = time.monotonic()
        time.sleep(0.01)
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    thread.join(timeout=5)
    out = "".join(line for _, line in lines)
    events: dict[str, float] = {}
    if killed is not None:
        events["killed"] = killed
        for name, pattern in (("detected", "failed (exitcode: -9)"), ("respawned", "prompts ("),
                              ("resumed", "resumed from")):
            after = [t for t, line in lines if t >= killed and pattern in line]
            if after:
                events[name] = after[0]
    if proc.returncode != 0 or not {"killed", "resumed"} <= events.keys():
        raise SystemExit(f"restart run failed (rc {proc.returncode}, events {sorted(events)}):\n{out[-3000:]}")
    resumed = RESUMED.search(out)
    shutil.rmtree(workdir, ignore_errors=True)
    k = events["killed"]
    detected = events.get("detected", k)
    respawned = events.get("respawned", detected)
    return {"model": model, "world": 2,
            "kill_to_resumed_s": round(events["resumed"] - k, 2),
            "detect_s": round(detected - k, 2),
            "respawn_s": round(respawned - detected, 2),
            "respawn_to_resumed_s": round(events["resumed"] - respawned, 2),
            "load_s": float(resumed.group(3)) if resumed else float("nan"),
            "total_wall_s": round(time.monotonic() - t_start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,100m")
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--restart_models", default="tiny", help="comma list; empty: skip the restart timing")
    parser.add_argument("--timeout", type=float, default=900, help="per run, seconds")
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    root = Path(args.workdir or tempfile.mkdtemp(prefix="rlrun_ckpt_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, list] = {"save_load": [], "restart": []}
    print(f"{'model':>6} {'world':>5} {'size MB':>9} {'files':>5} {'save s':>7} {'crc s':>6} {'load s':>7} {'crc s':>6}"
          "   (wall of the save / load runs; crc: the checksums' part of save and load)")
    for model in filter(None, args.models.split(",")):
        for nproc in (int(w) for w in args.worlds.split(",") if w):
            r = save_and_load(model, nproc, root, args.timeout)
            results["save_load"].append(r)
            print(f"{model:>6} {nproc:>5} {r['size_mb']:>9.1f} {r['files']:>5} {r['save_s']:>7.2f} "
                  f"{r['checksum_save_s']:>6.2f} {r['load_s']:>7.2f} {r['checksum_load_s']:>6.2f}"
                  f"   ({r['save_run_wall_s']} s / {r['load_run_wall_s']} s)", flush=True)
    for model in filter(None, args.restart_models.split(",")):
        r = restart(model, root, args.timeout)
        results["restart"].append(r)
        print(f"restart {model} (2 ranks, SIGKILL of rank 1 in step 2): kill -> resumed {r['kill_to_resumed_s']} s "
              f"= detect {r['detect_s']} + respawn to first log line {r['respawn_s']} + build and load "
              f"{r['respawn_to_resumed_s']} (load alone {r['load_s']} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
