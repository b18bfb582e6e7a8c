"""On-policy distillation's start-up (rlrun.plan.preflight, rlrun.plan.memory): the teacher must read the policy's
token ids as the policy does, which Qwen's real tokenizer shows is not the configs' vocab_size; a teacher of its own
size is planned with its own shape. The learning run is tests/supervised/test_pipeline.py's distillation stage."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import rlrun.ppo
from helpers import save_tiny_base
from rlrun.cli.parser import parse_args
from rlrun.config.model import PretrainedConfig
from rlrun.models.loading import load_tokenizer
from rlrun.plan.preflight import check_teacher_tokenizer
from rlrun.runtime.errors import ConfigError


def _with_config(source: Path, target: Path, **changes) -> Path:
    """A copy of a model folder whose config.json says otherwise (only config and tokenizer are read here)."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_a_teacher_with_the_policys_tokenizer_is_accepted_whatever_its_vocab_size(qwen_vocab_model, tmp_path):
    """Qwen2.5-1.5B pads its embeddings to 151936 rows and 7B to 152064, with one tokenizer: a 7B-like teacher of a
    1.5B-like student passes (TRL's vocab_size comparison would refuse it); a byte-tokenizer teacher does not."""
    padded = _with_config(qwen_vocab_model, tmp_path / "teacher_7b_like", vocab_size=152064)
    cfg = parse_args(["--pretrain", str(qwen_vocab_model), "--teacher_pretrain", str(padded)]).config
    tokenizer = load_tokenizer(PretrainedConfig(pretrain=str(qwen_vocab_model)))
    check_teacher_tokenizer(cfg.model, cfg.distill.teacher_pretrain, tokenizer)
    other = save_tiny_base(tmp_path / "byte_teacher")
    cfg = parse_args(["--pretrain", str(qwen_vocab_model), "--teacher_pretrain", other]).config
    with pytest.raises(ConfigError, match=r"tokenizer is not the policy's .*distillation across tokenizers"):
        check_teacher_tokenizer(cfg.model, cfg.distill.teacher_pretrain, tokenizer)
    short = _with_config(qwen_vocab_model, tmp_path / "teacher_short", vocab_size=151000)
    cfg = parse_args(["--pretrain", str(qwen_vocab_model), "--teacher_pretrain", str(short)]).config
    with pytest.raises(ConfigError, match="151000 embedding rows for the policy's 151936"):
        check_teacher_tokenizer(cfg.model, cfg.distill.teacher_pretrain, tokenizer)


def test_the_dry_run_checks_the_teacher_and_plans_it_with_its_own_shape(qwen_vocab_model, tmp_path, capsys,
                                                                      monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    teacher = _with_config(qwen_vocab_model, tmp_path / "teacher", num_hidden_layers=8, hidden_size=256,
                           intermediate_size=512, layer_types=["full_attention"] * 8)
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"question": "What is 2+3?", "answer": "5"}) + "\n")
    rc = rlrun.ppo.main(["--dry_run", "--pretrain", str(qwen_vocab_model), "--teacher_pretrain", str(teacher),
                         "--prompt_data", str(data), "--input_key", "question", "--label_key", "answer",
                         "--distill_task_reward", "false", "--rollout_batch_size", "1", "--micro_rollout_batch_size",
                         "1", "--train_batch_size", "1", "--micro_train_batch_size", "1", "--n_samples_per_prompt",
                         "1", "--advantage_estimator", "reinforce", "--init_kl_coef", "0", "--generation_backend",
                         "native"])
    out = capsys.readouterr()
    text = out.out + out.err
    assert rc == 0, text[-3000:]
    assert f"--teacher_pretrain {teacher}: reads the policy's token ids as it does" in text
    assert "actor,teacher,engine" in text  # unsized: on the actor's ranks
    assert "policy: 19.52M" in text and "teacher: 82.52M" in text  # its own 8 x 256 shape, not the policy's
    assert "reward: none; the policy learns from the teacher" in text
