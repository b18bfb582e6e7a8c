"""Checkpoints of the supervised trainers with real processes (torchrun + gloo, the embedded tiny model, rlrun.sft):
a rank SIGKILLed mid-run is restarted by elastic torchrun and the run ends exactly where an uninterrupted one does;
the same checkpoint resumes on another number of ranks; data-parallel training gives the single-rank numbers."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import RunResult, run_rlrun, subprocess_env, untimed
from rlrun.checkpoint import store as ckpt
from rlrun.supervised.datasets import write_all

STEPS = 6
SFT = ["--output_key", "output", "--input_template", "{}", "--train_batch_size", "8", "--micro_train_batch_size", "2",
       "--max_len", "48", "--learning_rate", "3e-3", "--max_steps", str(STEPS), "--save_steps", "2",
       "--dist_timeout", "30", "--lr_warmup_ratio", "0.2"]


def _sft(nproc: int, save: Path, data: Path, *extra: str, fault: str | None = None, max_restarts: int = 0) -> RunResult:
    env = subprocess_env(**({"RLRUN_FAULT": fault} if fault else {}))
    if not fault:
        env.pop("RLRUN_FAULT", None)
    return run_rlrun(nproc, ["--dataset", str(data), *SFT, "--ckpt_path", str(save / "ckpt"), *extra], save,
                     env=env, module="rlrun.sft", max_restarts=max_restarts)



def _same_weights(a: Path, b: Path, **tolerance: float) -> None:
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ta.keys() == tb.keys()
    for key in ta:
        if tolerance:
            torch.testing.assert_close(ta[key], tb[key], **tolerance)
        else:
            assert torch.equal(ta[key], tb[key]), key


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return Path(write_all(str(tmp_path_factory.mktemp("data")), sft=64, pairs=8, eval_pairs=8)["sft"])


@dataclass
class Reference:
    run: RunResult
    save: Path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data: Path) -> Reference:
    """2 ranks, uninterrupted, a checkpoint every 2 steps."""
    save = tmp_path_factory.mktemp("reference")
    run = _sft(2, save, data)
    assert run.returncode == 0, run.output[-4000:]
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    return Reference(run, save)


def test_killed_rank_restarts_and_ends_exactly_like_the_uninterrupted_run(reference, data, tmp_path) -> None:
    run = _sft(2, tmp_path, data, "--load_checkpoint", fault=f"train:{3}:1", max_restarts=2)
    assert run.returncode == 0, run.output[-4000:]
    assert "resumed from" in run.output and "at step 2" in run.output, run.output[-3000:]
    assert untimed(run.metrics) == untimed(reference.run.metrics)  # steps 3.. redone, earlier lines kept
    _same_weights(tmp_path, reference.save)
    found, _ = ckpt.find_latest(str(tmp_path / "ckpt"))
    assert found is not None and found.step == STEPS and found.meta["trainer"] == "sft"


def test_resume_on_one_rank_from_a_two_rank_checkpoint(reference, data, tmp_path) -> None:
    """The checkpoint of step 4 of the 2-rank run, resumed by 1 rank: the same last steps (float tolerance, the
    gradient is summed in another order) and no step redone twice."""
    src = reference.save / "ckpt"
    (tmp_path / "ckpt").mkdir(parents=True)
    shutil.copytree(ckpt.step_dir(str(src), 4), ckpt.step_dir(str(tmp_path / "ckpt"), 4))
    run = _sft(1, tmp_path, data, "--load_checkpoint")
    assert run.returncode == 0, run.output[-4000:]
    assert "at step 4" in run.output
    assert [m["step"] for m in run.metrics] == [5, 6]
    for mine, theirs in zip(run.metrics, reference.run.metrics[4:]):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4)
    _same_weights(tmp_path, reference.save, rtol=1e-4, atol=1e-5)


def test_one_rank_trains_like_two(reference, data, tmp_path) -> None:
    """Losses are normalised over the global batch: 1 rank x 4 micro-batches == 2 ranks x 2 micro-batches."""
    run = _sft(1, tmp_path, data)
    assert run.returncode == 0, run.output[-4000:]
    for mine, theirs in zip(run.metrics, reference.run.metrics, strict=True):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4) and mine["tokens"] == theirs["tokens"]
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-3)


def test_checkpoint_of_another_trainer_is_refused(reference, data, tmp_path) -> None:
    """An rlrun.dpo run pointed at rlrun.sft checkpoints fails fast with one clear line."""
    pairs = Path(data).parent / "pairs.jsonl"
    run = run_rlrun(2, ["--dataset", str(pairs), "--train_batch_size", "4", "--max_len", "48", "--max_steps", "1",
                        "--ckpt_path", str(reference.save / "ckpt"), "--load_checkpoint", "--dist_timeout", "30"],
                    tmp_path, module="rlrun.dpo")
    assert run.returncode != 0
    assert "was written by rlrun.sft, this is rlrun.dpo" in run.output, run.output[-3000:]
