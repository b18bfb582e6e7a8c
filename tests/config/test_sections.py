"""The config's sections are owned (issue 61): each in its owner's module with its own check(), none over 400 lines;
YAML files nested by the sections of earlier releases (a run's config.yaml, the recipes users copied) load to the same
config; OpenRLHF's --deepspeed_enable_sleep is rlrun's --sleep on the command line and in YAML; and the rollout
correction's thresholds refuse NaN and infinity under every spelling (issue 64: NaN silently skipped every update)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from rlrun.cli.parser import parse_args
from rlrun.config.supervised import DPOConfig, RMConfig, SFTConfig
from rlrun.config.tree import Config
from rlrun.runtime.errors import ConfigError

CONFIG = Path(__file__).resolve().parents[2] / "src" / "rlrun" / "config"


@pytest.mark.parametrize("root", [Config, SFTConfig, RMConfig, DPOConfig], ids=lambda r: r.__name__)
def test_every_section_checks_itself(root):
    for section in dataclasses.fields(root):
        value = getattr(root(), section.name)
        assert callable(getattr(value, "check", None)), f"{type(value).__name__} has no check()"
        value.check()  # the defaults pass


def test_no_section_module_is_a_catch_all():
    sizes = {p.name: len(p.read_text().splitlines()) for p in CONFIG.glob("*.py")}
    assert "schema.py" not in sizes
    assert max(sizes.values()) <= 400, sizes


def test_a_section_check_names_the_flag_and_value():
    with pytest.raises(ConfigError, match=r"^--top_p must be in \(0, 1\], got 1.5$"):
        parse_args(["--top_p", "1.5"]).config.generation.check()


OLD_LAYOUT = """
model:
  remote_rm_url: demo
  critic_pretrain: /models/critic
  freeze_prefix: [visual]
algo:
  advantage_estimator: gae
  value_clip: 0.3
  rollout_is: token
  rollout_is_threshold: "3.0"
  teacher_kl_coef: 0.5
train:
  critic_learning_rate: 2.0e-6
  deepspeed_enable_sleep: true
data:
  apply_chat_template: true
  max_pixels: 65536
logging:
  eval_dataset: data/test.jsonl
  eval_temperature: 0.8
checkpoint:
  save_value_network: true
"""

NEW_LAYOUT = """
reward:
  remote_rm_url: demo
critic:
  critic_pretrain: /models/critic
  critic_learning_rate: 2.0e-6
  value_clip: 0.3
  save_value_network: true
vision:
  freeze_prefix: [visual]
  max_pixels: 65536
algo:
  advantage_estimator: gae
correction:
  rollout_is: token
  rollout_is_threshold: "3.0"
distill:
  teacher_kl_coef: 0.5
train:
  sleep: true
template:
  apply_chat_template: true
eval:
  eval_dataset: data/test.jsonl
  eval_temperature: 0.8
"""


def test_yaml_in_the_former_sections_loads_as_today(tmp_path):
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(OLD_LAYOUT)
    new.write_text(NEW_LAYOUT)
    before, after = parse_args(["--config", str(old)]).config, parse_args(["--config", str(new)]).config
    assert before == after
    assert after.critic.value_clip == 0.3 and after.train.sleep and after.correction.rollout_is == "token"
    assert after.vision.freeze_prefix == ("visual",) and after.eval.eval_temperature == 0.8


def test_a_field_under_a_section_it_never_had_is_still_an_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("generation:\n  value_clip: 0.3\n")
    with pytest.raises(ConfigError, match="unknown key 'generation.value_clip'; 'value_clip' belongs in section 'critic'"):
        parse_args(["--config", str(bad)])


def test_deepspeed_enable_sleep_is_sleep(tmp_path):
    assert parse_args(["--deepspeed_enable_sleep"]).config.train.sleep
    assert parse_args(["--ds.enable_sleep"]).config.train.sleep
    assert parse_args(["--sleep", "true"]).config.train.sleep
    flat = tmp_path / "flat.yaml"
    flat.write_text("deepspeed_enable_sleep: true\n")
    assert parse_args(["--config", str(flat)]).config.train.sleep


NOT_FINITE = [
    ["--rollout_is", "token", "--rollout_is_threshold", "nan"],
    ["--rollout_is", "token", "--rollout_is_threshold", "inf"],
    ["--rollout_is", "sequence", "--rollout_is_threshold", "0.5_nan"],
    ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=nan"],
    ["--rollout_rs", "token_k1", "--rollout_rs_threshold", "nan"],
    ["--rollout_rs", "seq_mean_k3", "--rollout_rs_threshold", "inf"],
    ["--is_correction_level", "token", "--is_correction_threshold", "0.5", "inf"],
    ["--enable_vllm_is_correction", "--vllm_is_truncated_threshold", "0", "inf"],
]


@pytest.mark.parametrize("argv", NOT_FINITE, ids=[" ".join(a) for a in NOT_FINITE])
def test_correction_thresholds_refuse_nan_and_infinity(argv):
    from rlrun.plan.checks import check_values

    cfg = parse_args([*argv, "--generation_backend", "native"]).config
    with pytest.raises(ConfigError, match="finite"):
        check_values(cfg)


def test_a_finite_threshold_still_resolves():
    from rlrun.compat.correction import resolve

    cfg = parse_args(["--rollout_is", "token", "--rollout_is_threshold", "2.5"]).config
    weights = resolve(cfg.correction, cfg.algo.policy_loss_type).weights
    assert weights is not None and weights.bounds == (0.0, 2.5) and not math.isnan(weights.bounds[1])
