"""OpenRLHF 0.11 flags of train_sft / train_rm / train_dpo: every one is in rlrun's table with what it means here;
entries shared with train_ppo_ray are PPO's own, not copies."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from helpers import value_tokens
from rlrun.cli.parser import IGNORED_FLAGS
from rlrun.compat.openrlhf_flags import OPENRLHF_DOTTED, ByValue, Ignored, Meaning, Same, resolve, translate
from rlrun.compat.openrlhf_flags import (DPO_DOTTED, DPO_IGNORED, RM_DOTTED, RM_IGNORED, SFT_DOTTED,
                                                    SFT_IGNORED)
from rlrun.compat.argv import NOT_YET, refused
from rlrun.config.fields import fields_of
from rlrun.runtime.errors import ConfigError

PEER = Path("/work/peers/openrlhf/cli")

# The contract with rlrun.sft / rlrun.rm / rlrun.dpo: the (classic) field names each trainer has.
COMMON_FIELDS = {
    "pretrain", "model_preset", "bf16", "flash_attn", "attn_implementation", "gradient_checkpointing",
    "train_batch_size", "micro_train_batch_size", "max_epochs", "packing_samples", "max_samples", "max_steps",
    "learning_rate", "lr_warmup_ratio", "adam_betas", "max_norm", "max_skipped_steps", "l2", "zero_stage",
    "adam_offload", "strategy", "seed", "max_len", "dataset", "dataset_probs", "dataset_split", "eval_dataset",
    "eval_split", "input_template",
    "apply_chat_template", "tokenizer_chat_template", "save_path", "ckpt_path", "save_steps", "load_checkpoint",
    "max_ckpt_num", "logging_steps", "eval_steps", "metrics_file", "use_wandb", "wandb_org", "wandb_project",
    "wandb_group", "wandb_run_name", "use_tensorboard", "device", "dist_backend", "dist_timeout", "dry_run",
    "lora_rank", "lora_alpha", "target_modules", "lora_dropout", "save_merged", "sequence_parallel_size",
}
PAIR_FIELDS = {"prompt_key", "chosen_key", "rejected_key"}
FIELDS = {
    "sft": COMMON_FIELDS | {"input_key", "output_key", "pretrain_mode", "aux_loss_coef"},
    "rm": COMMON_FIELDS | PAIR_FIELDS | {"loss", "margin_loss"},
    "dpo": COMMON_FIELDS | PAIR_FIELDS | {"beta", "ipo", "label_smoothing", "nll_loss_coef", "ref_pretrain",
                                          "ref_offload"},
}
TABLES: dict[str, tuple[dict[str, Meaning], dict[str, tuple[int | str, str]]]] = {
    "sft": (SFT_DOTTED, SFT_IGNORED), "rm": (RM_DOTTED, RM_IGNORED), "dpo": (DPO_DOTTED, DPO_IGNORED),
}
TRAINERS = sorted(TABLES)
# Flags train_ppo_ray also has, with another meaning in these trainers.
OVERRIDES = {
    "ref.offload": "PPO's --ref.offload is ref_reward_offload; DPO's is ref_offload",
    "data.dataloader_num_workers": "PPO's reason names the prompt file",
}


def _peer_flags(trainer: str) -> dict[str, int | str]:
    """Every flag of OpenRLHF 0.11.2's cli/train_<trainer>.py (without '--') -> how many values it takes."""
    tree = ast.parse((PEER / f"train_{trainer}.py").read_text())
    flags: dict[str, int | str] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
            continue
        first = node.args[0]
        assert isinstance(first, ast.Constant) and first.value.startswith("--"), ast.dump(first)
        kw = {k.arg: k.value.value for k in node.keywords if isinstance(k.value, ast.Constant)}
        nargs: int | str = 0 if kw.get("action") in ("store_true", "store_false") else kw.get("nargs", 1)
        flags[first.value[2:]] = nargs
    return flags


needs_peer = pytest.mark.skipif(not PEER.exists(), reason="OpenRLHF 0.11.2 source not on this machine")


def _nargs(meaning: Meaning) -> int | str:
    return 1 if isinstance(meaning, ByValue) else meaning.nargs


@needs_peer
@pytest.mark.parametrize("trainer", TRAINERS)
def test_table_has_exactly_the_dotted_flags_of_openrlhf_0_11_2(trainer):
    table, _ = TABLES[trainer]
    assert {f for f in _peer_flags(trainer) if "." in f} == set(table)


@needs_peer
@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_entry_takes_as_many_values_as_openrlhf(trainer):
    table, ignored = TABLES[trainer]
    peer = _peer_flags(trainer)
    assert {name: _nargs(m) for name, m in table.items()} == {f: n for f, n in peer.items() if "." in f}
    for flag in (f for f in peer if "." not in f and f in ignored):
        assert ignored[flag][0] == peer[flag], flag


@needs_peer
@pytest.mark.parametrize("trainer", TRAINERS)
def test_undotted_flags_of_0_11_2_are_fields_or_reported(trainer):
    _, ignored = TABLES[trainer]
    undotted = {f for f in _peer_flags(trainer) if "." not in f}
    assert undotted == {"optim", "lr_scheduler", "lr_warmup_ratio", "min_lr_ratio", "max_norm", "local_rank", "use_ms"}
    assert not undotted - FIELDS[trainer] - set(ignored)


def test_table_sizes():
    # dotted flags of 0.11.2: train_sft.py 70, train_rm.py 72, train_dpo.py 75 (plus 7 undotted each)
    assert (len(SFT_DOTTED), len(RM_DOTTED), len(DPO_DOTTED)) == (70, 72, 75)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_every_target_is_a_field_or_a_reported_classic_flag(trainer):
    """A typo in a target would silently turn a supported flag into an ignored one; a missing field needs a reason."""
    table, ignored = TABLES[trainer]
    fields = FIELDS[trainer]
    for dotted, meaning in table.items():
        if isinstance(meaning, Same):
            assert meaning.field in fields or meaning.field in ignored, (dotted, meaning.field)
        if isinstance(meaning, ByValue):
            assert all(tok[2:] in fields for toks in meaning.tokens.values() for tok in toks if tok.startswith("--"))
    assert not set(ignored) & fields, "a field rlrun implements must leave the ignored list"


@pytest.mark.parametrize("trainer", TRAINERS)
def test_contract_matches_the_trainer_config(trainer):
    """The field list above is what rlrun.config.supervised defines (targets exist; nothing implemented is ignored)."""
    config = pytest.importorskip("rlrun.config.supervised")
    live = set(fields_of({"sft": config.SFTConfig, "rm": config.RMConfig, "dpo": config.DPOConfig}[trainer]))
    assert FIELDS[trainer] <= live
    assert not set(TABLES[trainer][1]) & live


@pytest.mark.parametrize("trainer", TRAINERS)
def test_shared_entries_are_ppos_own(trainer):
    """A flag train_ppo_ray also has is PPO's entry object (one definition), unless its meaning differs here."""
    table, _ = TABLES[trainer]
    for name in set(table) & set(OPENRLHF_DOTTED):
        if name in OVERRIDES:
            assert table[name] != OPENRLHF_DOTTED[name], name
        else:
            assert table[name] is OPENRLHF_DOTTED[name], name
    # The unprefixed optimizer flags come from the same helper as PPO's --actor.* ones.
    for suffix in ("adam.betas", "adam.eps", "adam.weight_decay"):
        assert table[suffix] == OPENRLHF_DOTTED[f"actor.{suffix}"], suffix
    assert table["adam.lr"] == Same("learning_rate", 1)
    assert table["muon.lr"] == Ignored(1, "only used with --optim muon; rlrun trains with AdamW only")


@pytest.mark.parametrize("trainer", TRAINERS)
def test_classic_ignored_agree_with_ppos_on_nargs(trainer):
    _, ignored = TABLES[trainer]
    for name in set(ignored) & set(IGNORED_FLAGS):
        assert ignored[name][0] == IGNORED_FLAGS[name][0], name


def _fields(trainer: str):
    config = pytest.importorskip("rlrun.config.supervised")
    return fields_of({"sft": config.SFTConfig, "rm": config.RMConfig, "dpo": config.DPOConfig}[trainer])


def test_dpo_command_line_of_0_11_translates_to_classic_flags():
    argv = ["--model.model_name_or_path", "/m", "--ref.model_name_or_path", "/r", "--model.beta", "0.1",
            "--model.ipo_enable", "--model.label_smoothing", "0.05", "--data.dataset", "d.jsonl",
            "--data.chosen_key", "c", "--train.batch_size", "64", "--adam.lr", "5e-7", "--adam.betas", "0.9", "0.99",
            "--ds.param_dtype", "bf16", "--ref.offload", "--ckpt.output_dir", "/out", "--eval.split", "train",
            "--ds.lora.rank", "0", "--model.nll_loss_coef", "0.2", "--muon.lr", "0.02", "--max_norm", "0.5",
            "--data.max_len", "1024", "--adam.weight_decay=0.1"]
    out = translate(argv, _fields("dpo"), DPO_IGNORED, DPO_DOTTED)
    assert out.argv == ["--pretrain", "/m", "--ref_pretrain", "/r", "--beta", "0.1", "--ipo", "--label_smoothing",
                        "0.05", "--dataset", "d.jsonl", "--chosen_key", "c", "--train_batch_size", "64",
                        "--learning_rate", "5e-7", "--adam_betas", "0.9", "0.99", "--bf16", "true", "--ref_offload",
                        "--save_path", "/out", "--eval_split", "train", "--lora_rank", "0", "--nll_loss_coef", "0.2",
                        "--max_norm", "0.5", "--max_len", "1024", "--l2=0.1"]
    assert out.ignored == ["--muon.lr: ignored (only used with --optim muon; rlrun trains with AdamW only)"]


def test_sft_and_rm_command_lines_translate():
    sft = translate(["--model.pretrain_mode_enable", "--data.input_key", "text", "--data.output_key", "out",
                     "--data.multiturn", "--ds.use_liger_kernel", "--ckpt.load_enable"],
                    _fields("sft"), SFT_IGNORED, SFT_DOTTED)
    assert sft.argv == ["--pretrain_mode", "--input_key", "text", "--output_key", "out", "--load_checkpoint"]
    assert sft.ignored == [f"--data.multiturn: ignored ({SFT_IGNORED['multiturn'][1]})",
                           f"--ds.use_liger_kernel: ignored ({NOT_YET})"]
    rm = translate(["--model.loss_type", "logexpsigmoid", "--data.prompt_key", "p", "--model.margin_loss_enable",
                    "--ds.value_head_prefix", "value_head", "--model.compute_fp32_loss_enable"],
                   _fields("rm"), RM_IGNORED, RM_DOTTED)
    assert rm.argv == ["--loss", "logexpsigmoid", "--prompt_key", "p", "--margin_loss"]
    assert [line.split(":")[0] for line in rm.ignored] == ["--ds.value_head_prefix", "--model.compute_fp32_loss_enable"]
    assert "fp32" in rm.ignored[1]


def test_bad_values_fail_under_the_dotted_name():
    with pytest.raises(ConfigError, match=r"--model\.loss_type"):
        translate(["--model.loss_type", "hinge"], _fields("rm"), RM_IGNORED, RM_DOTTED)
    with pytest.raises(ConfigError, match="unknown flag '--model.bta'; did you mean '--model.beta'"):
        translate(["--model.bta", "0.1"], _fields("dpo"), DPO_IGNORED, DPO_DOTTED)
    with pytest.raises(ConfigError, match=r"--ds\.param_dtype fp16: .*fp16 is not supported"):
        translate(["--ds.param_dtype", "fp16"], _fields("sft"), SFT_IGNORED, SFT_DOTTED)


@pytest.mark.parametrize("trainer", TRAINERS)
def test_missing_fields_report_the_trainers_reason(trainer):
    table, ignored = TABLES[trainer]
    fields = _fields(trainer)
    assert resolve("ckpt.save_hf", fields, ignored, table) == Ignored(0, NOT_YET)
    assert resolve("data.dataset_probs", fields, ignored, table) == Same("dataset_probs", 1)
    assert resolve("data.dataset_split", fields, ignored, table) == Same("dataset_split", 1)
    aux = resolve("model.aux_loss_coef", fields, ignored, table)
    if trainer == "sft":
        assert aux == Same("aux_loss_coef", 1)
    else:
        assert aux.reason.startswith("the MoE load-balancing loss")
    # A reported flag never resolves to a field the trainer lacks.
    for name in table:
        meaning = resolve(name, fields, ignored, table)
        assert not isinstance(meaning, Same) or meaning.field in fields


def test_rm_value_head_prefix_reason():
    meaning = resolve("ds.value_head_prefix", _fields("rm"), RM_IGNORED, RM_DOTTED)
    assert isinstance(meaning, Ignored) and "sequence-classification" in meaning.reason


def _spec(trainer: str):
    return pytest.importorskip(f"rlrun.{trainer}").CLI


@pytest.mark.parametrize("trainer", TRAINERS)
def test_each_dotted_flag_parses_as_its_classic_flag(trainer):
    """Through the trainer's real parser: rlrun-only flags around it catch a flag taking too many or too few values."""
    from rlrun.cli.parser import parse_args

    spec = _spec(trainer)
    fields = fields_of(spec.config_cls)
    base = parse_args(["--device", "cpu", "--dry_run"], spec).config
    checked = 0
    for dotted in spec.dotted:
        meaning = resolve(dotted, fields, spec.ignored, spec.dotted)
        if not isinstance(meaning, Same):
            continue
        values = value_tokens(fields[meaning.field])
        by_dotted = parse_args(["--device", "cpu", f"--{dotted}", *values, "--dry_run"], spec)
        by_classic = parse_args(["--device", "cpu", f"--{meaning.field}", *values, "--dry_run"], spec)
        assert by_dotted.config == by_classic.config != base, dotted
        assert by_dotted.explicit == by_classic.explicit == {"device", "dry_run", meaning.field}, dotted
        checked += 1
    assert checked >= 35


_VALUES: dict[int | str, list[str]] = {"*": ["q_proj", "k_proj"], 0: [], 1: ["8"], 2: ["0.2", "0.28"]}


@pytest.mark.parametrize("trainer", TRAINERS)
def test_each_ignored_flag_is_reported_and_its_values_consumed(trainer):
    from rlrun.cli.parser import parse_args

    spec = _spec(trainer)
    fields = fields_of(spec.config_cls)
    flags = [(f"--{name}", m.nargs, m.reason) for name in spec.dotted
             if isinstance(m := resolve(name, fields, spec.ignored, spec.dotted), Ignored)]
    flags += [(f"--{name}", nargs, reason) for name, (nargs, reason) in spec.ignored.items()]
    for flag, nargs, reason in flags:
        meaning = spec.dotted.get(flag[2:])
        classic = f"--{meaning.field}" if isinstance(meaning, Same) else flag
        if refused([(classic, _VALUES[nargs][0] if _VALUES[nargs] else None)]):  # issue 24 (7): refused instead
            with pytest.raises(ConfigError, match=rf"^{re.escape(flag)}\b"):
                parse_args(["--seed", "3", flag, *_VALUES[nargs]], spec)
            continue
        parsed = parse_args(["--seed", "3", flag, *_VALUES[nargs], "--max_epochs", "2"], spec)
        assert parsed.ignored == (f"{flag}: ignored ({reason})",), flag
        assert (parsed.config.train.seed, parsed.config.train.max_epochs) == (3, 2), flag
