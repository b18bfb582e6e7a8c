"""Tests for the typed config tree and its sources: defaults < YAML (--config) < CLI flags."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from helpers import REPO

from rlrun.cli.parser import build_parser, load_yaml, parse_args
from rlrun.config.fields import build_config, coerce, fields_of, redacted
from rlrun.config.tree import Config
from rlrun.runtime.errors import ConfigError

SECTIONS = [f.name for f in dataclasses.fields(Config)]


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- precedence ------------------------------------------------------------------------------------------------


def test_defaults_without_any_source():
    parsed = parse_args([])
    assert parsed.config == Config()
    assert parsed.explicit == frozenset()
    assert parsed.ignored == ()
    cfg = parsed.config
    assert cfg.train.seed == 42 and cfg.train.rollout_batch_size == 1024
    assert cfg.algo.advantage_estimator == "gae" and cfg.algo.init_kl_coef == 0.01
    assert cfg.algo.needs_critic and cfg.algo.needs_ref and not cfg.reward.needs_reward_model


NESTED = """
train:
  seed: 7
  rollout_batch_size: 64
  adam_betas: [0.8, 0.9]
algo:
  advantage_estimator: group_norm
  reward_clip_range: [-3, 3]
  value_clip: null
model:
  bf16: true
logging:
  use_tensorboard: ./tb
"""

FLAT = """
seed: 7
rollout_batch_size: 64
adam_betas: [0.8, 0.9]
advantage_estimator: group_norm
reward_clip_range: [-3, 3]
value_clip: null
bf16: true
use_tensorboard: ./tb
"""


@pytest.mark.parametrize("text", [NESTED, FLAT], ids=["nested", "flat"])
def test_yaml_overrides_defaults(tmp_path, text):
    parsed = parse_args(["--config", write(tmp_path, text)])
    cfg = parsed.config
    assert cfg.train.seed == 7
    assert cfg.train.rollout_batch_size == 64
    assert cfg.train.adam_betas == (0.8, 0.9)
    assert cfg.algo.advantage_estimator == "group_norm"
    assert cfg.algo.reward_clip_range == (-3.0, 3.0)
    assert cfg.critic.value_clip is None
    assert cfg.model.bf16 is True
    assert cfg.logging.use_tensorboard == "./tb"
    # Untouched fields keep their defaults.
    assert cfg.train.train_batch_size == 128 and cfg.algo.eps_clip == 0.2
    assert parsed.explicit == {"seed", "rollout_batch_size", "adam_betas", "advantage_estimator",
                               "reward_clip_range", "value_clip", "bf16", "use_tensorboard"}


@pytest.mark.parametrize("text", [NESTED, FLAT], ids=["nested", "flat"])
def test_cli_overrides_yaml(tmp_path, text):
    path = write(tmp_path, text)
    # Flags win whether they come before or after --config.
    for argv in (["--config", path, "--seed", "9", "--bf16", "false", "--value_clip", "0.3"],
                 ["--seed", "9", "--bf16", "false", "--value_clip", "0.3", "--config", path]):
        cfg = parse_args(argv).config
        assert cfg.train.seed == 9
        assert cfg.model.bf16 is False
        assert cfg.critic.value_clip == 0.3
        assert cfg.train.rollout_batch_size == 64  # from YAML
        assert cfg.train.micro_train_batch_size == 4  # default


def test_nested_and_flat_keys_mix_in_one_file(tmp_path):
    cfg = parse_args(["--config", write(tmp_path, "seed: 3\ntrain:\n  max_epochs: 2\n")]).config
    assert (cfg.train.seed, cfg.train.max_epochs) == (3, 2)


def test_dotted_flag_is_an_alias(tmp_path):
    path = write(tmp_path, "train:\n  seed: 7\n")
    assert parse_args(["--config", path, "--train.seed", "11"]).config.train.seed == 11
    assert parse_args(["--algo.eps_clip=0.1"]).config.algo.eps_clip == 0.1


def test_empty_yaml_is_all_defaults(tmp_path):
    assert parse_args(["--config", write(tmp_path, "")]).config == Config()


def test_yaml_values_are_coerced(tmp_path):
    # YAML 1.1 reads 1e8 as a string; OpenRLHF scripts write such numbers for integer flags.
    values = load_yaml(write(tmp_path, "max_samples: 1e8\nactor_learning_rate: 5e-7\nkl_target: None\n"))
    assert values == {"max_samples": 100_000_000, "actor_learning_rate": 5e-7, "kl_target": None}
    assert isinstance(values["max_samples"], int)


@pytest.mark.parametrize("text, wanted", [("use_wandb: true\n", ""), ("use_wandb: false\n", None),
                                          ("use_wandb: abc123\n", "abc123")])
def test_yaml_use_wandb_bool_means_on_or_off(tmp_path, text, wanted):
    # true: on, key from WANDB_API_KEY (like a bare --use_wandb); false: off. Never the key "True"/"False".
    assert parse_args(["--config", write(tmp_path, text)]).config.logging.use_wandb == wanted


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_parse(path):
    parse_args(["--config", str(path)])


# --- unknown keys and flags ------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, key, suggestion", [
    ("train:\n  rollout_batchsize: 4\n", "train.rollout_batchsize", "rollout_batch_size"),
    ("algo:\n  eps_clp: 0.1\n", "algo.eps_clp", "eps_clip"),
    ("rollout_batchsize: 4\n", "rollout_batchsize", "rollout_batch_size"),
    ("pretrian: x\n", "pretrian", "pretrain"),
    ("trian:\n  seed: 1\n", "trian", "train"),
], ids=["nested", "nested2", "flat", "flat2", "section"])
def test_unknown_yaml_key_suggests(tmp_path, text, key, suggestion):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        parse_args(["--config", path])
    msg = str(exc.value)
    assert path in msg and f"'{key}'" in msg
    assert f"did you mean '{suggestion}'?" in msg


def test_yaml_field_in_wrong_section_names_the_right_one(tmp_path):
    with pytest.raises(ConfigError, match=r"'model\.seed'.*belongs in section 'train'"):
        parse_args(["--config", write(tmp_path, "model:\n  seed: 3\n")])


def test_yaml_section_that_is_not_a_mapping(tmp_path):
    with pytest.raises(ConfigError) as exc:
        parse_args(["--config", write(tmp_path, "train: 5\n")])
    assert "section 'train' must be a mapping" in str(exc.value)
    assert "did you mean" not in str(exc.value)


@pytest.mark.parametrize("text, match", [
    ("- seed\n- 3\n", "top level must be a mapping"),
    ("seed: [1\n", "not valid YAML"),
])
def test_malformed_yaml(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        parse_args(["--config", write(tmp_path, text)])


@pytest.mark.parametrize("text, match", [
    ("seed: 42\npretrain: x\nseed: 7\n", r"'seed' is given twice in one mapping \(lines 1 and 3\)"),
    ("train:\n  seed: 42\n  micro_train_batch_size: 2\n  seed: 7\n", r"'seed' is given twice in one mapping \(lines 2 and 4\)"),
    ("seed: 42\ntrain:\n  seed: 7\n", r"'seed' is given twice, as 'seed' and as 'train.seed'"),
    ("model:\n  remote_rm_url: a\nreward:\n  remote_rm_url: b\n",
     r"'remote_rm_url' is given twice, as 'model.remote_rm_url' and as 'reward.remote_rm_url'"),
    ("sleep: true\ndeepspeed_enable_sleep: false\n", r"'sleep' is given twice, as 'sleep' and as 'deepspeed_enable_sleep'"),
], ids=["flat_twice", "nested_twice", "flat_and_nested", "former_and_new_section", "peer_spelling"])
def test_a_key_given_twice_is_an_error_naming_both_places(tmp_path, text, match):
    """Issue 64: yaml.safe_load kept the last of two equal keys, and a flat key beside its section's was dropped, both
    without a word."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=match) as exc:
        parse_args(["--config", path])
    assert path in str(exc.value) and "keep one" in str(exc.value)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path):
    """A mapping merged in with `<<` and one of its keys overridden is YAML's own meaning, not a duplicate."""
    path = write(tmp_path, "train:\n  <<: {seed: 3, micro_train_batch_size: 2}\n  seed: 5\n")
    assert load_yaml(path)["seed"] == 5 and load_yaml(path)["micro_train_batch_size"] == 2


def test_a_mapping_flag_with_a_key_twice_is_refused():
    info = next(i for i in fields_of(Config).values() if i.type is dict or getattr(i.type, "__origin__", None) is dict)
    with pytest.raises(ConfigError, match="gives 'a' twice"):
        coerce(info, '{"a": 1, "a": 2}', f"--{info.name}")


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        parse_args(["--config", str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize("argv, suggestion", [
    (["--rollout_batchsize", "4"], "--rollout_batch_size"),
    (["--seed", "1", "--actor_learning_rat=1e-6"], "--actor_learning_rate"),
    (["--advantage_estimater", "gae"], "--advantage_estimator"),
    (["--pretrian", "x"], "--pretrain"),
])
def test_unknown_flag_suggests(argv, suggestion):
    with pytest.raises(ConfigError) as exc:
        parse_args(argv)
    msg = str(exc.value)
    assert "unknown flag" in msg
    assert f"did you mean '{suggestion}'?" in msg


def test_unknown_flag_without_close_match_has_no_suggestion():
    with pytest.raises(ConfigError) as exc:
        parse_args(["--zzzzzzzz", "1"])
    assert "unknown flag '--zzzzzzzz'" in str(exc.value) and "did you mean" not in str(exc.value)


def test_stray_positional_is_an_error():
    with pytest.raises(ConfigError, match="unexpected argument 'oops'"):
        parse_args(["--seed", "1", "oops"])


def test_abbreviations_are_not_accepted():
    with pytest.raises(ConfigError, match="unknown flag"):
        parse_args(["--rollout_batch", "4"])


def test_flag_missing_its_value():
    with pytest.raises(ConfigError, match="--seed"):
        parse_args(["--seed"])


# --- type errors -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag, value, kind", [
    ("seed", "x", "integer"),
    ("rollout_batch_size", "1.5", "integer"),
    ("zero_stage", "two", "integer"),
    ("actor_num_gpus_per_node", "eight", "integer"),
    ("temperature", "hot", "number"),
    ("kl_target", "abc", "number"),
    ("eps_clip", "nan", "number"),
    ("bf16", "maybe", "true or false"),
    ("load_checkpoint", "2", "true or false"),
    ("advantage_estimator", "ppo", "one of"),
    ("kl_estimator", "k4", "one of"),
    ("device", "tpu", "one of"),
])
def test_cli_type_errors_name_flag_and_value(flag, value, kind):
    with pytest.raises(ConfigError) as exc:
        parse_args([f"--{flag}", value])
    msg = str(exc.value)
    assert f"--{flag}" in msg and repr(value) in msg and kind in msg


@pytest.mark.parametrize("text, flag, kind", [
    ("seed: abc\n", "seed", "integer"),
    ("seed: 1.5\n", "seed", "integer"),
    ("seed: true\n", "seed", "integer"),
    ("temperature: warm\n", "temperature", "number"),
    ("bf16: sometimes\n", "bf16", "true or false"),
    ("advantage_estimator: grpo\n", "advantage_estimator", "one of"),
    ("reward_clip_range: [1, 2, 3]\n", "reward_clip_range", "needs 2 values"),
    ("input_key: {a: 1}\n", "input_key", "string"),
])
def test_yaml_type_errors_name_field_file_and_value(tmp_path, text, flag, kind):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        parse_args(["--config", path])
    msg = str(exc.value)
    assert flag in msg and path in msg and kind in msg


def test_choice_error_suggests_close_choice():
    with pytest.raises(ConfigError, match="did you mean 'group_norm'"):
        parse_args(["--advantage_estimator", "group_nrm"])


def test_coerce_round_trips_every_default():
    for info in fields_of(Config).values():
        assert coerce(info, info.default, "test") == info.default, info.name


# --- secrets, help, structure ---------------------------------------------------------------------------------


def test_redacted_hides_wandb_key():
    cfg = parse_args(["--use_wandb", "sekrit-key-123", "--seed", "5"]).config
    assert cfg.logging.use_wandb == "sekrit-key-123"
    out = redacted(cfg)
    assert out["logging"]["use_wandb"] == "<redacted>"
    assert "sekrit-key-123" not in repr(out)
    assert out["train"]["seed"] == 5  # everything else is kept, nested by section
    assert set(out) == set(SECTIONS)
    assert cfg.logging.use_wandb == "sekrit-key-123"  # the config itself is untouched


def test_redacted_keeps_unset_secret_as_none():
    assert redacted(Config())["logging"]["use_wandb"] is None


def test_bare_use_wandb_means_key_from_environment():
    assert parse_args(["--use_wandb"]).config.logging.use_wandb == ""
    assert parse_args(["--use_wandb", "--seed", "1"]).config.logging.use_wandb == ""


def test_every_field_has_help_text():
    infos = fields_of(Config)
    assert len(infos) > 80
    for info in infos.values():
        assert isinstance(info.help, str) and info.help.strip(), info.name


def test_field_names_are_unique_and_sections_match_config():
    infos = fields_of(Config)
    assert {i.section for i in infos.values()} == set(SECTIONS)
    cfg = Config()
    for info in infos.values():
        assert getattr(getattr(cfg, info.section), info.name) == info.default


def test_build_config_places_fields_in_their_sections():
    cfg = build_config({"seed": 1, "bf16": True, "eps_clip": 0.1, "use_wandb": None}, Config)
    assert (cfg.train.seed, cfg.model.bf16, cfg.algo.eps_clip) == (1, True, 0.1)


def test_help_is_grouped_by_section():
    text = build_parser().format_help()
    positions = []
    for section in SECTIONS:
        assert f"\n{section}:\n" in text, section
        positions.append(text.index(f"\n{section}:\n"))
    assert positions == sorted(positions)  # sections in Config order
    # Each flag is listed under its own section's header.
    infos = fields_of(Config)
    for name in ("pretrain", "actor_num_gpus_per_node", "temperature", "seed", "eps_clip", "prompt_data",
                 "save_path", "use_wandb", "dry_run"):
        section = infos[name].section
        start = text.index(f"\n{section}:\n")
        nxt = [p for p in positions if p > start]
        end = nxt[0] if nxt else len(text)
        assert f"--{name}" in text[start:end], name
    assert "--config" in text
    # Every field is a flag in the help.
    for name in infos:
        assert f"--{name}" in text, name


def test_help_flag_prints_and_exits_zero(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--help"])
    assert exc.value.code == 0
    assert "\ntrain:\n" in capsys.readouterr().out


def test_help_shows_defaults():
    text = " ".join(build_parser().format_help().split())  # argparse wraps to the terminal width
    assert math.isclose(fields_of(Config)["eps_clip"].default, 0.2)
    assert "PPO clip range. (default: 0.2)" in text
