"""The supervised trainers on both strategies (real DeepSpeed 0.19 on CPU, gloo, 2 ranks, torchrun): the same
SFT run gives the same numbers under FSDP2 and DeepSpeed ZeRO-2 and ZeRO-3; DPO's frozen reference and the reward model's
scalar head run under DeepSpeed too, and their exports load with transformers."""

from __future__ import annotations

import pytest
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from helpers import run_rlrun
from rlrun.supervised.datasets import write_all

pytest.importorskip("deepspeed")

COMMON = ["--train_batch_size", "8", "--micro_train_batch_size", "2", "--max_len", "48", "--max_steps", "3",
          "--dist_timeout", "60", "--lr_warmup_ratio", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    return write_all(str(tmp_path_factory.mktemp("data")), sft=32, pairs=32, eval_pairs=8)


def test_sft_numbers_match_between_fsdp_and_deepspeed(data, tmp_path) -> None:
    """FSDP2, DeepSpeed ZeRO-2 and ZeRO-3 (the role spans the world here): the same losses and gradient norms."""
    args = ["--dataset", data["sft"], "--output_key", "output", "--input_template", "{}", "--learning_rate", "3e-3", *COMMON]
    fsdp = run_rlrun(2, args + ["--strategy", "fsdp"], tmp_path / "fsdp", module="rlrun.sft")
    assert fsdp.returncode == 0, fsdp.output[-4000:]
    assert len(fsdp.metrics) == 3
    for stage in (2, 3):
        out = tmp_path / f"ds{stage}"
        deepspeed = run_rlrun(2, args + ["--strategy", "deepspeed", "--zero_stage", str(stage)], out, module="rlrun.sft")
        assert deepspeed.returncode == 0, deepspeed.output[-4000:]
        assert len(deepspeed.metrics) == 3
        for a, b in zip(fsdp.metrics, deepspeed.metrics):
            assert a["tokens"] == b["tokens"]
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (stage, a, b)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3), (stage, a, b)
        AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.parametrize(("module", "stage"), [("rlrun.dpo", 1), ("rlrun.rm", 1), ("rlrun.dpo", 3)])
def test_pair_trainers_run_under_deepspeed(module, stage, data, tmp_path) -> None:
    """ZeRO-3 DPO: the frozen reference is partitioned too."""
    args = ["--dataset", data["pairs"], "--eval_dataset", data["pairs_eval"], "--learning_rate", "1e-3",
            "--strategy", "deepspeed", "--zero_stage", str(stage), *COMMON]
    run = run_rlrun(2, args, tmp_path, module=module)
    assert run.returncode == 0, run.output[-4000:]
    train = [m for m in run.metrics if "loss" in m]
    evals = [m for m in run.metrics if "eval/acc" in m]
    assert len(train) == 3 and len(evals) == 1 and evals[0]["step"] == 3
    if module == "rlrun.rm":
        model = AutoModelForSequenceClassification.from_pretrained(tmp_path)
        assert model.config.mean == pytest.approx(evals[0]["eval/reward_mean"])
    else:
        assert train[0]["loss"] == pytest.approx(0.693147, abs=1e-5)  # the first step's policy is its reference
        AutoModelForCausalLM.from_pretrained(tmp_path)
