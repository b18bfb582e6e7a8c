"""LoRA (--lora_rank) in the supervised trainers, with real processes (torchrun, gloo, the embedded tiny model): SFT
on 2 ranks (FSDP2) learns while only its adapters train (the base weights after training bit-identical to a fresh
load, optimizer state for the adapters alone); DPO under DeepSpeed ZeRO-2 learns against the policy's own base
(adapters disabled) with no reference copy; the reward model trains its score head whole beside the adapters."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from helpers import run_rlrun
from rlrun.config.model import PretrainedConfig
from rlrun.models.loading import load_causal_lm
from rlrun.models.lora import hf_name, is_adapter
from rlrun.runtime.errors import ConfigError
from rlrun.plan.checks import check_lora, reference_is_base
from rlrun.supervised.assembly import reward_model
from rlrun.config.supervised import DPOConfig, DPOLossConfig
from rlrun.supervised.datasets import write_all

SEED = 42  # --seed's default: the embedded model's fresh heads and the adapters' A matrices are drawn from it
LORA = ["--lora_rank", "8", "--lora_alpha", "32", "--eval_before_train", "--lr_warmup_ratio", "0", "--max_len", "48",
        "--train_batch_size", "8", "--dist_timeout", "60"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    return write_all(str(tmp_path_factory.mktemp("data")), sft=32, pairs=32, eval_pairs=8)


def _checkpoint(step_dir: Path, tmp_path: Path) -> dict:
    """A checkpoint's model and optimizer state (DCP, gathered whole) under their parameter names."""
    dcp_to_torch_save(str(step_dir / "model"), str(tmp_path / "state.pt"))
    return torch.load(tmp_path / "state.pt", weights_only=False)


def _optimized(optim: dict) -> set[str]:
    """The parameter names a checkpoint's optimizer holds state for (torch's nested layout, or rlrun's DeepSpeed
    one, flat by name)."""
    return set(optim["state"]) if "state" in optim else set(optim)


def _evals(metrics: list[dict], key: str) -> list[float]:
    return [m[key] for m in metrics if key in m]


def test_sft_with_lora_learns_on_two_ranks_and_leaves_the_base_weights_untouched(data, tmp_path) -> None:
    """8 steps (2 epochs of 32): the held-in eval loss falls, the checkpoint's base weights equal a fresh load bit
    for bit, no lora_B left at zero, and the optimizer holds state for the adapters only; --save_merged's model
    loads in transformers."""
    out = tmp_path / "out"
    run = run_rlrun(2, ["--dataset", data["sft"], "--eval_dataset", data["sft"], "--output_key", "output",
                        "--input_template", "{}", "--micro_train_batch_size", "2", "--learning_rate", "3e-2",
                        "--save_steps", "8", "--ckpt_path", str(tmp_path / "ckpt"), "--save_merged", *LORA],
                    out, module="rlrun.sft")
    assert run.returncode == 0, run.output[-4000:]
    assert "LoRA rank 8 alpha 32 on all-linear: 16,384 of 123,840 parameters trained" in run.output, run.output[-3000:]
    losses = _evals(run.metrics, "eval/loss")
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.15, losses  # 5.56 -> 5.34 when written

    state = _checkpoint(tmp_path / "ckpt" / "step_00000008", tmp_path)
    trained, optim = state["model"], state["optim"]
    base = load_causal_lm(PretrainedConfig(), SEED).state_dict()
    frozen = {hf_name(n): t for n, t in trained.items() if not is_adapter(n)}
    assert frozen.keys() == base.keys()
    changed = [n for n in base if not torch.equal(frozen[n], base[n])]
    assert not changed, f"{len(changed)} base weights changed in training, e.g. {changed[:3]}"
    adapters = {n for n in trained if is_adapter(n)}
    assert adapters and all(trained[n].abs().sum() > 0 for n in adapters if ".lora_B." in n)  # B starts at zero
    assert _optimized(optim) == adapters, sorted(_optimized(optim) ^ adapters)[:5]
    AutoModelForCausalLM.from_pretrained(out / "merged")
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()


def test_dpo_with_lora_under_deepspeed_learns_against_the_base_without_a_reference_copy(data, tmp_path) -> None:
    """ZeRO-2 on 2 ranks. The first step's loss is ln 2 (policy = reference); that the margin then grows shows the
    reference is not the adapted policy, and no reference model is built (its log line)."""
    pytest.importorskip("deepspeed")
    run = run_rlrun(2, ["--dataset", data["pairs"], "--eval_dataset", data["pairs_eval"], "--micro_train_batch_size", "2",
                        "--learning_rate", "3e-2", "--max_steps", "4", "--strategy", "deepspeed", "--zero_stage", "2",
                        "--save_steps", "4", "--ckpt_path", str(tmp_path / "ckpt"), *LORA], tmp_path / "out",
                    module="rlrun.dpo")
    assert run.returncode == 0, run.output[-4000:]
    assert "the reference is the policy's base model with its adapters disabled; no reference copy is built" in run.output
    train = [m for m in run.metrics if "loss" in m]
    assert train[0]["loss"] == pytest.approx(0.693147, abs=1e-5)
    loss, acc, margin = (_evals(run.metrics, k) for k in ("eval/loss", "eval/acc", "eval/margin"))
    assert margin[0] == 0.0 and margin[-1] > 0.05, margin
    assert loss[-1] < loss[0] - 0.05 and acc[-1] > acc[0], (loss, acc)  # 0.693 -> 0.603, 0.0 -> 0.875 when written
    optim = _checkpoint(tmp_path / "ckpt" / "step_00000004", tmp_path)["optim"]
    assert _optimized(optim) and all(is_adapter(n) for n in _optimized(optim)), sorted(_optimized(optim))[:5]


def test_reward_model_with_lora_trains_its_score_head_whole(data, tmp_path) -> None:
    """One process (no torchrun): eval accuracy rises, and the merged export's score head moved from its seeded start (a head outside
    the adapters, trained whole)."""
    out = tmp_path / "out"
    run = run_rlrun(0, ["--dataset", data["pairs"], "--eval_dataset", data["pairs_eval"], "--micro_train_batch_size", "4",
                        "--learning_rate", "3e-3", "--max_epochs", "2", "--save_merged", *LORA], out, module="rlrun.rm")
    assert run.returncode == 0, run.output[-4000:]
    assert "parameters trained (15.32%, the score head whole)" in run.output, run.output[-3000:]
    loss, acc = _evals(run.metrics, "eval/loss"), _evals(run.metrics, "eval/acc")
    assert loss[-1] < loss[0] - 0.1 and acc[-1] > acc[0], (loss, acc)  # 0.691 -> 0.489, 0.5 -> 0.875 when written
    fresh = reward_model(PretrainedConfig(), SEED).fill(torch.device("cpu")).hf.score.weight
    merged = AutoModelForSequenceClassification.from_pretrained(out / "merged", num_labels=1).score.weight
    assert (merged - fresh).abs().max() > 1e-3


def _dpo(pretrain: str | None, ref: str | None, rank: int = 8) -> DPOConfig:
    cfg = DPOConfig(loss=DPOLossConfig(ref_pretrain=ref))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pretrain=pretrain, lora_rank=rank))


def test_the_dpo_reference_is_the_base_unless_another_model_is_named(tmp_path) -> None:
    """--ref_pretrain unset or --pretrain itself (any spelling of its path): the base with adapters off; another
    model: a separate frozen reference (OpenRLHF's behaviour); no LoRA: always a reference model."""
    model = tmp_path / "sft"
    model.mkdir()
    def base(cfg: DPOConfig) -> bool:
        return reference_is_base(cfg.model, cfg.loss)

    assert base(_dpo(None, None)) and base(_dpo(str(model), None))
    assert base(_dpo(str(model), str(tmp_path / "." / "sft")))
    assert not base(_dpo(str(model), str(tmp_path / "other")))
    assert not base(_dpo(None, None, rank=0))


def test_an_adapter_directory_as_the_dpo_policy_is_refused(tmp_path) -> None:
    """Its adapters-off model would be the adapter's base, not the initial policy."""
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "base_model_name_or_path": "base"}')
    with pytest.raises(ConfigError, match="is a LoRA adapter directory: .* pass the merged model as --pretrain"):
        check_lora(_dpo(str(tmp_path), None))
    check_lora(_dpo(str(tmp_path), "/elsewhere/ref"))  # a separate reference is that model, whatever --pretrain is
