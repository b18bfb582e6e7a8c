"""config.yaml in a run's save path (rlrun.reporting.run_report): `--config <save_path>/config.yaml` parses to the
same config, whichever spellings the run was started with, for every trainer; secrets and the dry-run-only
settings stay out."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from rlrun.cli.parser import PPO_CLI, CliSpec, parse_args
from rlrun.dpo import CLI as DPO_CLI
from rlrun.cli.run_config import NOT_SAVED, run_settings, write_run_config
from rlrun.rm import CLI as RM_CLI
from rlrun.sft import CLI as SFT_CLI


def _flat(cfg) -> dict:
    return {k: v for section in dataclasses.asdict(cfg).values() for k, v in section.items()}


def _rerun(cfg, spec: CliSpec, tmp_path):
    path, count = write_run_config(cfg, spec.defaults, str(tmp_path), spec.prog, "world size 2, launcher torchrun")
    return parse_args(["--config", path], spec).config, path, count


# The three spellings, a YAML file under them, tuples, dicts, multi-line strings and an explicit default.
PPO_ARGS = ["--config", "configs/demo.yaml", "--is_correction_threshold", "0.5", "2",
            "--rollout.n_samples_per_prompt", "8", "actor_rollout_ref.actor.optim.lr=3e-6",
            "--input_template", "Q: {}\nA:", "--seed", "42", "--save_path", "runs/x", "--stop_properly_penalty_coef", "0.5"]


def test_ppo_config_round_trips(tmp_path) -> None:
    cfg = parse_args(PPO_ARGS).config
    again, path, count = _rerun(cfg, PPO_CLI, tmp_path)
    assert again == cfg
    text = open(path).read()
    assert text.startswith("# python -m rlrun.ppo: the settings of the run saved in")
    assert f"# Rerun: python -m rlrun.ppo --config {path}" in text and "world size 2, launcher torchrun" in text
    stored = yaml.safe_load(text)
    assert stored["train"]["n_samples_per_prompt"] == 8 and stored["correction"]["is_correction_threshold"] == [0.5, 2.0]
    assert "seed" not in stored["train"]  # only what differs from the defaults
    assert count == sum(len(v) for v in stored.values())


@pytest.mark.parametrize("spec, args", [
    (SFT_CLI, ["--dataset", "d.jsonl", "--max_epochs", "3", "--adam.lr", "1e-6"]),
    (RM_CLI, ["--dataset", "d.jsonl", "--max_len", "1024", "--train.batch_size", "16"]),
    (DPO_CLI, ["--dataset", "d.jsonl", "--beta", "0.2", "--learning_rate", "9e-6"]),
])
def test_supervised_configs_round_trip_with_their_own_defaults(tmp_path, spec, args) -> None:
    cfg = parse_args(args, spec).config
    again, path, _ = _rerun(cfg, spec, tmp_path)
    assert again == cfg
    assert "ckpt_path" not in open(path).read()  # the trainer's own default, not written


def test_an_empty_difference_still_loads(tmp_path) -> None:
    cfg = parse_args([]).config
    again, path, count = _rerun(cfg, PPO_CLI, tmp_path)
    assert count == 0 and again == cfg


def test_secrets_stay_out_and_are_named(tmp_path) -> None:
    key = "0123456789abcdef0123456789abcdef01234567"
    cfg = parse_args(["--use_wandb", key, "--remote_rm_url", "https://user:pw@rm.example/score?token=abc"]).config
    again, path, _ = _rerun(cfg, PPO_CLI, tmp_path)
    text = open(path).read()
    assert key not in text and "pw" not in text and "token=abc" not in text
    assert "Not stored as given (secrets): remote_rm_url, use_wandb (its key: set WANDB_API_KEY)" in text
    assert again.logging.use_wandb == ""  # on, the key from WANDB_API_KEY
    assert again.reward.remote_rm_url == "https://<redacted>@rm.example/score?<redacted>"


def test_dry_run_settings_are_not_stored(tmp_path) -> None:
    cfg = parse_args(["--dry_run", "--plan_json", "p.json", "--gpu_memory_gb", "40", "--max_steps", "5"]).config
    settings, withheld = run_settings(cfg, {})
    assert settings == {"train": {"max_steps": 5}} and withheld == []
    again, _, _ = _rerun(cfg, PPO_CLI, tmp_path)
    differ = {k for k, v in _flat(cfg).items() if _flat(again)[k] != v}
    assert differ == {"dry_run", "plan_json", "gpu_memory_gb"} <= NOT_SAVED
