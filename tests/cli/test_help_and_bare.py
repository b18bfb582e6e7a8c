"""--help opens with a short usage (how to start, the common flags, the spellings, where the rest is) before the full
grouped list; the spellings it shows mean the same config; a bare `python -m rlrun.ppo` says in one line what to
pass."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from helpers import REPO, subprocess_env
from rlrun.cli.parser import PPO_CLI, build_parser, parse_args, spelling_examples
from rlrun.dpo import CLI as DPO_CLI
from rlrun.rm import CLI as RM_CLI
from rlrun.runtime.errors import ConfigError
from rlrun.sft import CLI as SFT_CLI

SPECS = [PPO_CLI, SFT_CLI, RM_CLI, DPO_CLI]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.prog)
def test_help_opens_with_the_short_usage(spec) -> None:
    text = build_parser(spec).format_help()
    head, _, rest = text.partition("\noptions:\n")
    assert rest, text[:2000]
    usage = head.splitlines()[0]
    assert usage.startswith(f"usage: {spec.prog} [--config FILE]") and len(usage) < 100
    assert len(head.splitlines()) <= 30  # short: the grouped list of every flag comes after it
    for part in ("start here:", "--dry_run", "SAVE_PATH/config.yaml", "common flags:", "--pretrain", "--save_path",
                 "spellings", "classic", "dotted", "docs/compat.md", "Every flag follows, by section"):
        assert part in head, part
    assert ("verl" in head) == spec.verl_overrides
    assert "\ntrain:\n" in rest and "--seed" in rest  # the full list follows


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.prog)
def test_every_spelling_shown_means_the_same(spec) -> None:
    examples = spelling_examples(spec)
    assert set(examples) == ({"classic", "dotted", "verl"} if spec.verl_overrides else {"classic", "dotted"})
    configs = {name: parse_args(shlex.split(text), spec) for name, text in examples.items()}
    classic = configs["classic"]
    assert classic.config != parse_args([], spec).config  # the examples do set something
    for name, parsed in configs.items():
        assert parsed.config == classic.config, name
        assert parsed.ignored == (), (name, parsed.ignored)


def test_ppo_start_examples_parse() -> None:
    for _, command in PPO_CLI.start:
        argv = shlex.split(command.replace("\\\n", " "))
        args = argv[argv.index("rlrun.ppo") + 1:]
        parse_args([a.replace("MODEL", "m").replace("FILE", "p.jsonl") for a in args])


def test_bare_command_line_says_what_to_pass(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["rlrun.ppo"])
    with pytest.raises(ConfigError) as exc:
        parse_args()
    message = str(exc.value)
    assert "\n" not in message and "--prompt_data" in message and "--config" in message and "demo.yaml" in message
    assert parse_args([]).config == parse_args(["--seed", "42"]).config  # an explicit empty list: the defaults
    parse_args(None, SFT_CLI)  # the supervised trainers say what they need in their own check (--dataset)


def test_bare_python_dash_m_rlrun_ppo_is_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "rlrun.ppo"], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "nothing to train" in lines[0] and "configs/demo.yaml" in lines[0], lines
