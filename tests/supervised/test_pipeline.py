"""The offline pipeline example, end to end with real processes (torchrun, 2 ranks, gloo, the embedded tiny
model): SFT -> reward model -> PPO under that reward model, DPO from the SFT model, and the SFT model distilled into
a fresh one on-policy (examples/pipeline/run.sh). Each stage must visibly learn."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, subprocess_env


def _metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) of a metrics.jsonl."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if "loss" in r or "reward" in r], [r for r in rows if any(k.startswith("eval/") for k in r)]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pipeline")
    proc = subprocess.run(["bash", "examples/pipeline/run.sh", str(out), "2"], cwd=REPO, capture_output=True, text=True,
                          env=subprocess_env(RLRUN_PYTHON=sys.executable), timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return out


def test_sft_loss_falls(pipeline: Path) -> None:
    train, _ = _metrics(pipeline / "sft" / "metrics.jsonl")
    assert len(train) == 32  # 256 records / 16 per step x 2 epochs
    first, last = statistics.mean(r["loss"] for r in train[:3]), statistics.mean(r["loss"] for r in train[-3:])
    assert last < first - 1.5, (first, last)
    assert (pipeline / "sft" / "model.safetensors").exists() and (pipeline / "sft" / "tokenizer.json").exists()


def test_reward_model_learns_held_out_pairs_and_stores_its_reward_statistics(pipeline: Path) -> None:
    _, evals = _metrics(pipeline / "rm" / "metrics.jsonl")
    before, after = evals[0], evals[-1]
    assert before["step"] == 0 and after["step"] == 16
    assert after["eval/acc"] >= 0.85 and after["eval/acc"] > before["eval/acc"] + 0.3, (before, after)
    assert after["eval/margin"] > 0.5
    config = json.loads((pipeline / "rm" / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification") and len(config["id2label"]) == 1
    assert config["mean"] == pytest.approx(after["eval/reward_mean"]) and config["std"] == pytest.approx(after["eval/reward_std"])


def test_ppo_reward_under_the_trained_reward_model_rises(pipeline: Path) -> None:
    train, _ = _metrics(pipeline / "ppo" / "metrics.jsonl")
    first, last = statistics.mean(r["reward"] for r in train[:3]), statistics.mean(r["reward"] for r in train[-5:])
    assert last > first + 0.2, [round(r["reward"], 3) for r in train]


def test_dpo_margin_and_accuracy_rise_from_the_sft_model(pipeline: Path) -> None:
    _, evals = _metrics(pipeline / "dpo" / "metrics.jsonl")
    before, after = evals[0], evals[-1]
    # At step 0 the policy is its reference: every implicit reward, and so the margin, is exactly 0.
    assert before["eval/margin"] == 0.0 and before["eval/loss"] == pytest.approx(0.693147, abs=1e-5)
    assert after["eval/margin"] > 0.2 and after["eval/acc"] >= 0.85 and after["eval/loss"] < 0.6, after


def test_distillation_moves_a_fresh_student_to_its_teacher_without_a_reward(pipeline: Path) -> None:
    """configs/distill_demo.yaml: the student learns from each token's divergence to the SFT teacher alone
    (--distill_task_reward false); the demo rule still scores every sample, and those scores rise with it."""
    train, _ = _metrics(pipeline / "distill" / "metrics.jsonl")
    kl = [r["distill/teacher_kl"] for r in train]
    rewards = [r["reward"] for r in train]
    # seeds 42, 1 and 2 end (last five steps) at 1/3.3, 1/3.3 and 1/25 of the first three steps' divergence
    assert statistics.mean(kl[-5:]) < statistics.mean(kl[:3]) / 2.5, [round(k, 3) for k in kl]
    assert statistics.mean(rewards[-5:]) > statistics.mean(rewards[:3]) + 0.3, [round(r, 3) for r in rewards]
    # pure distillation: the group advantages of the (unused) reward are 0, so what is left is the teacher's term
    assert all(r["distill/teacher_logprob"] < 0 for r in train)
