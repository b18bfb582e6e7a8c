"""LoRA flags (issue 28) in OpenRLHF's spellings: classic (<= 0.10: --lora_rank, --target_modules q_proj v_proj) and
0.11's dotted --ds.lora.* reach cfg.model for rlrun.ppo and rlrun.sft/rm/dpo, with OpenRLHF's defaults; 4-bit
loading (QLoRA) is refused in one line; --help lists the flags."""

from __future__ import annotations

import pytest

from rlrun.cli.parser import IGNORED_FLAGS, PPO_CLI, build_parser, parse_args
from rlrun.compat.openrlhf_flags import DPO_IGNORED, RM_IGNORED, SFT_IGNORED
from rlrun.compat.argv import CHANGES_TRAINING
from rlrun.dpo import CLI as DPO_CLI
from rlrun.rm import CLI as RM_CLI
from rlrun.runtime.errors import ConfigError
from rlrun.sft import CLI as SFT_CLI

REWARD = ["--remote_rm_url", "demo"]
LORA_FIELDS = ("lora_rank", "lora_alpha", "target_modules", "lora_dropout")
CLIS = {"ppo": PPO_CLI, "sft": SFT_CLI, "rm": RM_CLI, "dpo": DPO_CLI}


def _lora(cli_name: str, argv: list[str]):
    parsed = parse_args([*argv, *(REWARD if cli_name == "ppo" else [])], CLIS[cli_name])
    model = parsed.config.model
    return parsed, (model.lora_rank, model.lora_alpha, model.target_modules, model.lora_dropout)


def test_defaults_are_openrlhfs():
    """OpenRLHF: --lora_rank 0, --lora_alpha 16, --target_modules all-linear, --lora_dropout 0; --save_merged off."""
    for name, cli in CLIS.items():
        parsed, lora = _lora(name, [])
        assert lora == (0, 16, ("all-linear",), 0.0), name
        assert parsed.config.checkpoint.save_merged is False


@pytest.mark.parametrize("name", sorted(CLIS))
def test_classic_flags_with_several_target_modules(name):
    parsed, lora = _lora(name, ["--lora_rank", "16", "--lora_alpha", "32", "--target_modules", "q_proj", "k_proj",
                                "v_proj", "--lora_dropout", "0.05", "--save_merged"])
    assert lora == (16, 32, ("q_proj", "k_proj", "v_proj"), 0.05)
    assert parsed.config.checkpoint.save_merged is True
    assert not [line for line in parsed.ignored if "lora" in line or "target_modules" in line], parsed.ignored


@pytest.mark.parametrize("name", sorted(CLIS))
def test_openrlhf_0_11_dotted_flags_equal_the_classic_ones(name):
    dotted, lora = _lora(name, ["--ds.lora.rank", "16", "--ds.lora.alpha", "32", "--ds.lora.target_modules", "q_proj",
                                "v_proj", "--ds.lora.dropout", "0.1", "--seed", "3"])
    classic, _ = _lora(name, ["--lora_rank", "16", "--lora_alpha", "32", "--target_modules", "q_proj", "v_proj",
                              "--lora_dropout", "0.1", "--seed", "3"])
    assert lora == (16, 32, ("q_proj", "v_proj"), 0.1)
    assert dotted.config == classic.config and not dotted.ignored


def test_target_modules_forms():
    """One value, a comma-separated list (verl's and YAML's spelling), the '=' form; later flags win."""
    assert _lora("ppo", ["--target_modules", "all-linear"])[1][2] == ("all-linear",)
    assert _lora("ppo", ["--target_modules", "q_proj,v_proj"])[1][2] == ("q_proj", "v_proj")
    assert _lora("ppo", ["--ds.lora.target_modules=q_proj,o_proj"])[1][2] == ("q_proj", "o_proj")
    assert _lora("ppo", ["--target_modules", "q_proj", "--ds.lora.target_modules", "v_proj"])[1][2] == ("v_proj",)


@pytest.mark.parametrize("flag", ["--target_modules", "--ds.lora.target_modules"])
def test_target_modules_without_a_value_is_one_line(flag):
    """OpenRLHF's nargs='*' reads a bare flag as [], which PEFT cannot adapt: an error naming the flag as typed."""
    with pytest.raises(ConfigError) as err:
        parse_args([flag, "--seed", "1", *REWARD])
    assert flag in str(err.value) and "at least one" in str(err.value) and "\n" not in str(err.value)


def test_lora_flags_left_the_ignored_tables():
    for table in (IGNORED_FLAGS, SFT_IGNORED, RM_IGNORED, DPO_IGNORED):
        assert not set(LORA_FIELDS) & set(table)
    assert not {"lora_rank", "ds.lora.rank", "actor_rollout_ref.model.lora_rank"} & set(CHANGES_TRAINING)


@pytest.mark.parametrize(("name", "flag"), [("ppo", "--load_in_4bit"), ("ppo", "--ds.load_in_4bit"),
                                            ("sft", "--load_in_4bit"), ("dpo", "--ds.load_in_4bit")])
def test_4bit_loading_is_refused_with_the_reason(name, flag):
    with pytest.raises(ConfigError) as err:
        _lora(name, [flag, "--lora_rank", "8"])
    text = str(err.value)
    assert text.startswith(f"{flag}: bitsandbytes 4-bit loading is CUDA-only and rlrun does not implement QLoRA")
    assert "use --lora_rank on a bf16 base model" in text and "\n" not in text


@pytest.mark.parametrize("cli", [PPO_CLI, SFT_CLI, RM_CLI, DPO_CLI], ids=lambda c: c.prog)
def test_help_lists_the_lora_flags(cli):
    text = build_parser(cli).format_help()
    for flag in ("--lora_rank", "--lora_alpha", "--target_modules", "--lora_dropout", "--save_merged"):
        assert flag in text, flag
    assert "all-linear" in text
