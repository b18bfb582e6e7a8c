"""Checkpoints with real processes: exact resume, elastic restarts after a SIGKILL, resizing the
world, corrupt and incompatible checkpoints (torchrun + gloo on the embedded tiny model).

One uninterrupted reference run (2 ranks, GAE: actor + critic + reference, 4 steps, a checkpoint
every 2) is shared by the module; every interrupted or resumed run is compared with it. Batches
are shrunk so that a run is mostly process start-up.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import REPO, subprocess_env
from rlrun import checkpoint as ckpt

N = 2  # save every N steps; the reference runs 2N
STEPS = 2 * N
SMALL = ["--config", "configs/demo.yaml", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2",
         "--train_batch_size", "8", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "2",
         "--generate_max_len", "8", "--dist_timeout", "30"]
GAE = ["--advantage_estimator", "gae", "--init_kl_coef", "0.01", "--save_value_network"]
TIMING_KEYS = ("time/", "tokens_per_s")


@dataclass
class Run:
    returncode: int
    output: str
    metrics: list[dict]
    wall_s: float
    save: Path

    @property
    def ckpt(self) -> Path:
        return self.save / "ckpt"


def torchrun(nproc: int, args: list[str], save: Path, *, fault: str | None = None, max_restarts: int = 0,
             ckpt_path: Path | None = None, timeout: float = 200) -> Run:
    """torchrun --standalone [--max-restarts R] -m rlrun.ppo ARGS --save_path SAVE --ckpt_path SAVE/ckpt."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"--max-restarts={max_restarts}", "-m", "rlrun.ppo", *args,
           "--save_path", str(save), "--ckpt_path", str(ckpt_path or save / "ckpt")]
    env = subprocess_env(**({"RLRUN_FAULT": fault} if fault else {}))
    if not fault:
        env.pop("RLRUN_FAULT", None)
    start = time.monotonic()
    # A session of its own, so a timeout takes the workers down with the launcher.
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout} s: {' '.join(cmd)}\n{output[-3000:]}")
    metrics_file = save / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    return Run(proc.returncode, output, metrics, time.monotonic() - start, save)


def _ok(run: Run) -> None:
    assert run.returncode == 0, run.output[-4000:]


def _no_timing(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(TIMING_KEYS)} for m in metrics]


def _assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = load_file(a), load_file(b)
    assert ta.keys() == tb.keys()
    different = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not different, f"{len(different)} tensors differ between {a} and {b}, e.g. {different[:3]}"


def _assert_same_final_models(run: Run, ref: Run) -> None:
    _assert_same_tensors(run.save / "model.safetensors", ref.save / "model.safetensors")
    _assert_same_tensors(run.save / "critic" / "model.safetensors", ref.save / "critic" / "model.safetensors")


def _copy_checkpoints(src: Run, dst_root: Path, *steps: int) -> None:
    dst_root.mkdir(parents=True)
    for step in steps:
        shutil.copytree(ckpt.step_dir(str(src.ckpt), step), ckpt.step_dir(str(dst_root), step))


def _assert_clean_newest(root: Path, step: int) -> None:
    """The newest checkpoint is `step`, validates, and nothing unfinished is left behind."""
    assert not [p.name for p in root.iterdir() if p.name.startswith(".tmp_step_")]
    found, warnings = ckpt.find_latest(str(root))
    assert warnings == []
    assert found is not None and found.step == step
    ckpt.validate(found.path)
    assert json.loads((root / ckpt.LATEST).read_text())["step"] == step


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Run:
    """Uninterrupted: 2 ranks, GAE with critic and reference, 2N steps, a checkpoint every N."""
    run = torchrun(2, SMALL + GAE + ["--max_steps", str(STEPS), "--save_steps", str(N)],
                   tmp_path_factory.mktemp("reference"))
    _ok(run)
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    assert sorted(p.name for p in run.ckpt.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    return run


# ---- exact resume --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_is_exact(reference, tmp_path):
    """Resuming from step N reproduces the uninterrupted run: metrics of steps N+1..2N (timings aside),
    final policy and critic weights, bit for bit."""
    _copy_checkpoints(reference, tmp_path / "ckpt", N)
    run = torchrun(2, SMALL + GAE + ["--max_steps", str(STEPS), "--save_steps", str(N), "--load_checkpoint"], tmp_path)
    _ok(run)
    assert f"resumed from {ckpt.step_dir(str(run.ckpt), N)} at step {N}" in run.output
    assert [m["step"] for m in run.metrics] == list(range(N + 1, STEPS + 1))
    assert _no_timing(run.metrics) == _no_timing(reference.metrics[N:])
    _assert_same_final_models(run, reference)
    _assert_clean_newest(run.ckpt, STEPS)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(reference, tmp_path):
    _copy_checkpoints(reference, tmp_path / "ckpt", N, STEPS)
    shard = tmp_path / "ckpt" / "step_00000004" / "actor" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    run = torchrun(2, SMALL + GAE + ["--max_steps", str(STEPS), "--save_steps", str(N), "--load_checkpoint"], tmp_path)
    _ok(run)
    warning = [line for line in run.output.splitlines() if "warning" in line and "skipping checkpoint" in line]
    assert len(warning) == 1 and "step_00000004" in warning[0] and "actor/__1_0.distcp" in warning[0], run.output[-3000:]
    assert f"resumed from {ckpt.step_dir(str(run.ckpt), N)} at step {N}" in run.output
    assert _no_timing(run.metrics) == _no_timing(reference.metrics[N:])
    _assert_same_final_models(run, reference)
    _assert_clean_newest(run.ckpt, STEPS)  # the corrupt step 4 was replaced by a good one


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_checkpoints_corrupt_starts_fresh(reference, tmp_path):
    _copy_checkpoints(reference, tmp_path / "ckpt", N, STEPS)
    (tmp_path / "ckpt" / "step_00000002" / "actor" / "__0_0.distcp").unlink()
    (tmp_path / "ckpt" / "step_00000004" / ckpt.COMPLETE).write_text("{garbage")
    run = torchrun(1, SMALL + GAE + ["--max_steps", "1", "--save_steps", str(N), "--load_checkpoint"], tmp_path)
    _ok(run)
    assert "no complete checkpoint" in run.output and "starting fresh" in run.output
    warnings = [line for line in run.output.splitlines() if "skipping checkpoint" in line]
    assert len(warnings) == 2, run.output[-3000:]
    assert [m["step"] for m in run.metrics] == [1]
    # The fresh run's final save (step 1) supersedes the corrupt leftovers of the abandoned run.
    assert sorted(p.name for p in run.ckpt.iterdir()) == ["latest", "step_00000001"]
    _assert_clean_newest(run.ckpt, 1)


# ---- elastic restarts after a SIGKILL ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_mid_step_restarts_and_matches_the_uninterrupted_run(reference, tmp_path):
    """Rank 1 is SIGKILLed in the train phase of step N+1; torchrun restarts the group, which resumes
    from step N: one metrics line per step, and the same result as if nothing had happened."""
    run = torchrun(2, SMALL + GAE + ["--max_steps", str(STEPS), "--save_steps", str(N), "--load_checkpoint"],
                   tmp_path, fault=f"train:{N}:1", max_restarts=2)
    _ok(run)
    assert "Signal 9 (SIGKILL)" in run.output or "SIGKILL" in run.output, run.output[-3000:]
    assert f"resumed from {ckpt.step_dir(str(run.ckpt), N)} at step {N}" in run.output
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    assert _no_timing(run.metrics) == _no_timing(reference.metrics)
    _assert_same_final_models(run, reference)
    _assert_clean_newest(run.ckpt, STEPS)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("phase", ["save", "save_shards"])
def test_kill_mid_save_restarts_and_leaves_a_loadable_checkpoint(reference, tmp_path, phase):
    """Rank 1 is SIGKILLed while saving the step-2N checkpoint: on entering the save ("save", before
    anything is written) or after writing its shards, before the checkpoint is sealed ("save_shards").
    The restarted group resumes from step N, saves step 2N again and ends like the uninterrupted run."""
    run = torchrun(2, SMALL + GAE + ["--max_steps", str(STEPS), "--save_steps", str(N), "--load_checkpoint"],
                   tmp_path, fault=f"{phase}:{STEPS - 1}:1", max_restarts=2)
    _ok(run)
    assert "SIGKILL" in run.output, run.output[-3000:]
    assert f"resumed from {ckpt.step_dir(str(run.ckpt), N)} at step {N}" in run.output
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    assert _no_timing(run.metrics) == _no_timing(reference.metrics)
    _assert_same_final_models(run, reference)
    _assert_clean_newest(run.ckpt, STEPS)
    if phase == "save_shards":
        # The checkpoint loads: one more step, on 4 ranks (a 2-rank checkpoint, resharded).
        more = torchrun(4, SMALL + GAE + ["--max_steps", str(STEPS + 1), "--save_steps", str(N), "--load_checkpoint"],
                        tmp_path)
        _ok(more)
        assert f"resumed from {ckpt.step_dir(str(run.ckpt), STEPS)} at step {STEPS}" in more.output
        assert [m["step"] for m in more.metrics] == list(range(1, STEPS + 2))
        _assert_clean_newest(more.ckpt, STEPS + 1)
        AutoModelForCausalLM.from_pretrained(more.save)


# ---- resizing the world --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_on_fewer_ranks(tmp_path):
    """A checkpoint saved by 4 ranks (GRPO demo) continues on 2 at the next step."""
    first = torchrun(4, SMALL + ["--max_steps", str(N), "--save_steps", str(N)], tmp_path)
    _ok(first)
    assert json.loads((first.ckpt / "step_00000002" / ckpt.COMPLETE).read_text())["meta"]["world_size"] == 4
    run = torchrun(2, SMALL + ["--max_steps", str(N + 1), "--save_steps", str(N), "--load_checkpoint"], tmp_path)
    _ok(run)
    assert f"resumed from {ckpt.step_dir(str(run.ckpt), N)} at step {N}" in run.output
    # The first run's lines are kept; the resumed run starts at N+1.
    assert [m["step"] for m in run.metrics] == list(range(1, N + 2))
    assert _no_timing(run.metrics[:N]) == _no_timing(first.metrics)
    _assert_clean_newest(run.ckpt, N + 1)
    AutoModelForCausalLM.from_pretrained(run.save)


# ---- incompatible checkpoint ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoint_of_a_different_architecture_fails_fast_and_clearly(reference, tmp_path):
    from rlrun.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config

    config = tiny_model_config()
    config.hidden_size, config.intermediate_size = 32, 96  # same layer names, other shapes
    model_dir = tmp_path / "narrow_model"
    build_causal_lm(config, seed=0).save_pretrained(model_dir)
    build_byte_tokenizer().save_pretrained(model_dir)
    _copy_checkpoints(reference, tmp_path / "ckpt", N)

    run = torchrun(2, SMALL + GAE + ["--pretrain", str(model_dir), "--max_steps", str(STEPS), "--save_steps", str(N),
                                     "--load_checkpoint"], tmp_path, timeout=120)
    assert run.returncode != 0
    lines = [line for line in run.output.splitlines() if "different policy architecture" in line]
    # Every rank stops at once with the same one-line reason (none is left waiting in a collective) ...
    assert len(lines) == 2, run.output[-3000:]
    for rank, line in enumerate(sorted(lines)):
        assert f"rank {rank}: FAILED" in line and "in phase load: CheckpointError" in line, line
        assert "lm_head.weight: checkpoint [259, 64] vs model [259, 32]" in line, line
    assert run.output.count("exitcode  : 1 ") == 2, run.output[-3000:]
    assert "collective failed" not in run.output and "SIGKILL" not in run.output
    # ... quickly: well before any collective timeout (--dist_timeout 30) could be involved.
    assert run.wall_s < 60, run.wall_s
    assert [m["step"] for m in run.metrics] == []
