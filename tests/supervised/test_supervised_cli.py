"""The command lines of rlrun.sft, rlrun.rm and rlrun.dpo: generated from their config trees like rlrun.ppo's,
each trainer's OpenRLHF defaults, OpenRLHF's classic and dotted spellings, and one clear error for bad input
before anything starts (real processes for the exit codes)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import subprocess
import sys

import pytest

from helpers import REPO, subprocess_env
from rlrun.cli.parser import parse_args
from rlrun.dpo import CLI as DPO_CLI
from rlrun.rm import CLI as RM_CLI
from rlrun.runtime.errors import ConfigError
from rlrun.sft import CLI as SFT_CLI
from rlrun.config.supervised import DPOConfig, RMConfig, SFTConfig
from rlrun.plan.checks import check_supervised


def test_each_trainer_has_openrlhf_defaults() -> None:
    sft = parse_args([], SFT_CLI).config
    rm = parse_args([], RM_CLI).config
    dpo = parse_args([], DPO_CLI).config
    assert isinstance(sft, SFTConfig) and isinstance(rm, RMConfig) and isinstance(dpo, DPOConfig)
    assert (sft.train.learning_rate, rm.train.learning_rate, dpo.train.learning_rate) == (5e-6, 9e-6, 1e-5)
    assert (sft.train.max_len, rm.train.max_len, dpo.train.max_len) == (2048, 512, 512)
    assert (sft.train.max_epochs, rm.train.micro_train_batch_size, dpo.train.micro_train_batch_size) == (2, 1, 8)
    assert sft.template.input_template == "User: {}\nAssistant: " and dpo.template.input_template is None
    assert (sft.checkpoint.ckpt_path, rm.checkpoint.ckpt_path) == ("./ckpt/checkpoints_sft", "./ckpt/checkpoints_rm")
    assert dpo.loss.beta == 0.1 and rm.loss.loss == "sigmoid"


def test_classic_and_dotted_spellings_give_the_same_config() -> None:
    classic = ["--pretrain", "m", "--dataset", "d.jsonl", "--beta", "0.2", "--ipo", "--label_smoothing", "0.1",
               "--ref_offload", "--learning_rate", "5e-7", "--train_batch_size", "64", "--micro_train_batch_size", "2",
               "--max_len", "1024", "--zero_stage", "3", "--save_path", "out", "--chosen_key", "c", "--rejected_key", "r",
               "--nll_loss_coef", "0.2", "--ref_pretrain", "ref"]
    dotted = ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl", "--model.beta", "0.2", "--model.ipo_enable",
              "--model.label_smoothing", "0.1", "--ref.offload", "--adam.lr", "5e-7", "--train.batch_size", "64",
              "--train.micro_batch_size", "2", "--data.max_len", "1024", "--ds.zero_stage", "3",
              "--ckpt.output_dir", "out", "--data.chosen_key", "c", "--data.rejected_key", "r",
              "--model.nll_loss_coef", "0.2", "--ref.model_name_or_path", "ref"]
    assert parse_args(classic, DPO_CLI).config == parse_args(dotted, DPO_CLI).config


def test_openrlhf_flags_rlrun_does_not_act_on_are_reported() -> None:
    parsed = parse_args(["--multiturn", "--overlap_comm", "--output_key", "o"], SFT_CLI)
    assert parsed.config.data.output_key == "o"
    text = "\n".join(parsed.ignored)
    for flag in ("--multiturn", "--overlap_comm"):
        assert f"{flag}: ignored (" in text, text
    assert "--model.aux_loss_coef: ignored (" in "\n".join(parse_args(["--model.aux_loss_coef", "0"], DPO_CLI).ignored)


def test_sft_takes_the_moe_aux_loss_in_both_spellings_and_refuses_it_on_a_dense_policy() -> None:
    from rlrun.plan.plan import check_sft_aux_loss as _check_aux

    for argv in (["--aux_loss_coef", "0.01"], ["--model.aux_loss_coef", "0.01"]):
        parsed = parse_args(argv, SFT_CLI)
        assert parsed.config.loss.aux_loss_coef == 0.01 and not parsed.ignored
    with pytest.raises(ConfigError, match=r"--aux_loss_coef 0.01: the policy \(qwen2\) has no MoE layers"):
        _check_aux(parse_args(["--aux_loss_coef", "0.01"], SFT_CLI).config)
    with pytest.raises(ConfigError, match="--aux_loss_coef must be >= 0, got -1"):
        _check_aux(parse_args(["--aux_loss_coef", "-1"], SFT_CLI).config)


@pytest.mark.parametrize("cli", [SFT_CLI, RM_CLI, DPO_CLI])
def test_lora_flags_in_classic_and_dotted_spellings_set_the_lora_fields(cli) -> None:
    classic = parse_args(["--lora_rank", "8", "--lora_alpha", "32", "--target_modules", "q_proj", "v_proj",
                          "--lora_dropout", "0.05", "--save_merged"], cli)
    dotted = parse_args(["--ds.lora.rank", "8", "--ds.lora.alpha", "32", "--ds.lora.target_modules", "q_proj", "v_proj",
                         "--ds.lora.dropout", "0.05", "--save_merged"], cli)
    model = classic.config.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules, model.lora_dropout) == (8, 32, ("q_proj", "v_proj"), 0.05)
    assert classic.config.checkpoint.save_merged and not classic.ignored
    assert dotted.config == classic.config


@pytest.mark.parametrize(("argv", "message", "cli"), [
    (["--model.aux_loss_coef", "0.1"], "implemented for rlrun.ppo and rlrun.sft only: it would", DPO_CLI),
    (["--aux_loss_coef", "0.1"], "implemented for rlrun.ppo and rlrun.sft only: it would", RM_CLI),
    (["--load_in_4bit"], "QLoRA", SFT_CLI)])
def test_openrlhf_flags_that_would_change_what_is_trained_are_refused(argv, message, cli) -> None:
    with pytest.raises(ConfigError) as err:
        parse_args(argv, cli)
    assert str(err.value).startswith(argv[0]) and message in str(err.value), err.value


def test_a_flag_of_another_trainer_is_an_error_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"unknown flag '--beta'"):
        parse_args(["--beta", "0.1"], SFT_CLI)
    with pytest.raises(ConfigError, match=r"did you mean '--chosen_key'"):
        parse_args(["--chosen_kye", "c"], RM_CLI)
    with pytest.raises(ConfigError, match=r"loss \(from --model.loss_type\) must be one of sigmoid, logexpsigmoid"):
        parse_args(["--model.loss_type", "hinge"], RM_CLI)


@pytest.mark.parametrize(("cli", "argv", "message"), [
    (SFT_CLI, [], "needs --dataset"),
    (SFT_CLI, ["--dataset", "d", "--train_batch_size", "3"], "must be a multiple of the 2 ranks"),
    (DPO_CLI, ["--dataset", "d", "--beta", "0"], "--beta must be > 0"),
    (DPO_CLI, ["--dataset", "d", "--label_smoothing", "0.5"], "--label_smoothing must be in [0, 0.5)"),
    (RM_CLI, ["--dataset", "d", "--learning_rate", "0"], "--learning_rate must be > 0"),
    (SFT_CLI, ["--dataset", "d", "--strategy", "deepspeed", "--zero_stage", "0", "--bf16", "--save_steps", "5"],
     "--zero_stage 0 --bf16 cannot save or load checkpoints yet"),
    (SFT_CLI, ["--dataset", "d", "--strategy", "deepspeed", "--zero_stage", "0", "--adam_offload"],
     "DeepSpeed offloads the optimizer only at ZeRO stages 1-3"),
    (DPO_CLI, ["--dataset", "d", "--flash_attn"], "--flash_attn needs --bf16"),
    (DPO_CLI, ["--dataset", "d", "--ref_offload"], "--ref_offload needs --zero_stage 3 with --strategy fsdp"),
])
def test_bad_settings_fail_before_anything_starts(cli, argv, message) -> None:
    with pytest.raises(ConfigError) as err:
        check_supervised(parse_args(argv, cli).config, 2, cli.prog)
    assert message in str(err.value)


def test_bad_input_is_one_line_on_every_rank_and_a_nonzero_exit(tmp_path) -> None:
    """A missing dataset file: one error line (from rank 0) naming the flag, exit status non-zero, no rlrun traceback
    (torchrun prints its own ChildFailedError summary)."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
                           "rlrun.rm", "--dataset", str(tmp_path / "missing.jsonl"), "--train_batch_size", "2",
                           "--save_path", str(tmp_path / "out")], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert f"--dataset {tmp_path / 'missing.jsonl'}: no such file" in output, output[-3000:]
    assert not re.search(r'File ".*[/\\]rlrun[/\\]', output), output[-3000:]
    assert sum(line.startswith("[rlrun") and "FAILED" in line for line in output.splitlines()) == 1, output[-3000:]


def test_dry_run_reads_the_data_as_training_will(tmp_path) -> None:
    """--dry_run is the Slurm scripts' preflight: the dataset is read and tokenized, its first sample shown as the
    model sees it; a path this machine lacks is named, not an error; a bad key fails with one line, exit 2. In process
    (rlrun.dpo's main, as `python -m rlrun.dpo` calls it): scripts/slurm/train.sh's preflight runs it as a process in
    tests/scripts/test_slurm_scripts.py."""
    from rlrun.dpo import main

    def dry(*args: str) -> tuple[int, str]:
        text = io.StringIO()
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            code = main(["--train_batch_size", "4", "--dry_run", *args])
        return code, text.getvalue()

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "2+3?", "chosen": "5", "rejected": "6"}) + "\n")
    code, out = dry("--dataset", str(pairs), "--prompt_key", "prompt")
    assert code == 0, out[-2000:]
    assert "1 ranks" in out and "4 samples per rank" in out
    assert f"--dataset {pairs}: 1 samples (0 dropped, 0 truncated at --max_len 512); the first as the model sees " \
           "it: {'prompt': '2+3?', 'chosen': '5 <|eos|>', 'rejected': '6 <|eos|>', 'margin': 0.0}" in out
    assert "memory plan of a CPU run" in out and re.search(r"^0 +\| 0 +\| policy,ref \| train +\|", out, re.M), out
    code, out = dry("--dataset", str(tmp_path / "elsewhere.jsonl"))
    assert code == 0 and "is not on this machine" in out
    code, out = dry("--dataset", str(pairs), "--chosen_key", "better")
    errors = [line for line in out.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1 and "better" in errors[0], errors



@pytest.mark.parametrize("module, roles", [("rlrun.sft", "model"), ("rlrun.rm", "model"), ("rlrun.dpo", "policy,ref")])
def test_dry_run_prints_a_memory_plan_per_rank(module, roles, tmp_path, monkeypatch) -> None:
    """In process, for a world of 16 ranks on nodes of 8 (as scripts/slurm/train.sh plans one): the plan for GPUs of
    --gpu_memory_gb, in rlrun.ppo's format; a --pretrain of a hub id's shape that is not here (an earlier stage's
    `out/sft`) is named, and the plan says it is skipped, without failing the dry run."""
    from rlrun.models import hub

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
                       "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}.items():
        monkeypatch.setenv(key, value)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"chosen": "5", "rejected": "6", "input": "2+3?", "output": "5"}) + "\n")
    argv = ["--dataset", str(pairs), "--train_batch_size", "16", "--dry_run",
            *(["--output_key", "output"] if module == "rlrun.sft" else [])]
    main = importlib.import_module(module).main
    text = io.StringIO()
    hub.resolve.cache_clear()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        assert main([*argv, "--gpu_memory_gb", "80"]) == 0
        assert main([*argv, "--pretrain", "out/sft"]) == 0
    hub.resolve.cache_clear()
    out = text.getvalue()
    assert "memory plan, GiB per rank at its peak phase, for GPUs of 80.0 GiB (--gpu_memory_gb)" in out, out
    assert re.search(rf"^1-15 +\| 0-1 +\| {roles} +\| train +\|", out, re.M), out  # rank 0 also writes the export
    assert "memory plan skipped: --pretrain out/sft is not on this machine" in out, out
    assert "--pretrain out/sft: not on this machine: a path not written yet (an earlier stage's output?)" in out, out
