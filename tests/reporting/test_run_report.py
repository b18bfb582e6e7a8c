"""The start-up lines every trainer prints on rank 0 (rlrun.reporting.run_report, rlrun.cli.run_config): where the outputs go, the config
written, the reward source, a large layout in one line; and the supervised trainers' evaluation in the step lines."""

from __future__ import annotations

import pytest

from rlrun.cli.parser import PPO_CLI, parse_args
from rlrun.cli.run_config import write_run_config
from rlrun.reporting.metrics import format_eval
from rlrun.reporting.run_report import announce, describe_roles, saved_outputs
from rlrun.rl.assembly import describe_reward
from rlrun.sft import CLI as SFT_CLI


def test_announce_writes_the_config_and_names_every_output(tmp_path) -> None:
    save = tmp_path / "run"
    cfg = parse_args(["--save_path", str(save), "--save_steps", "5", "--ckpt_path", str(tmp_path / "ck"),
                      "--use_tensorboard", str(tmp_path / "tb")]).config
    path, count = write_run_config(cfg, {}, cfg.checkpoint.save_path, PPO_CLI.prog, "world size 1, launcher single")
    where, config = announce(cfg.model, cfg.checkpoint, cfg.logging, PPO_CLI.prog, path, count)
    assert where == (f"outputs in {save}: the model (Hugging Face format), config.yaml, metrics.jsonl, summary.json, "
                     f"curves.png; checkpoints every 5 steps in {tmp_path / 'ck'}; also to TensorBoard {tmp_path / 'tb'}")
    assert config == (f"config: {save / 'config.yaml'} (4 settings differ from the defaults; rerun with "
                      f"python -m rlrun.ppo --config {save / 'config.yaml'})")
    assert (save / "config.yaml").exists()
    assert saved_outputs(cfg.model, cfg.checkpoint, critic="c") == {
        "model": str(save), "critic": "c", "checkpoints": str(tmp_path / "ck"), "config": str(save / "config.yaml")}


def test_a_metrics_file_elsewhere_is_named(tmp_path) -> None:
    cfg = parse_args(["--dataset", "d.jsonl", "--save_path", str(tmp_path / "m"), "--metrics_file",
                      str(tmp_path / "logs" / "exp.jsonl")], SFT_CLI).config
    path, count = write_run_config(cfg, SFT_CLI.defaults, cfg.checkpoint.save_path, SFT_CLI.prog)
    where, _ = announce(cfg.model, cfg.checkpoint, cfg.logging, SFT_CLI.prog, path, count)
    assert where == (f"outputs: the model (Hugging Face format) and config.yaml in {tmp_path / 'm'}; exp.jsonl, "
                     f"exp_summary.json, exp_curves.png in {tmp_path / 'logs'}; no checkpoints (--save_steps -1) but one a preemption notice asks for")


@pytest.mark.parametrize("args, text", [
    ([], "reward: the demo rule"),
    (["--remote_rm_url", "demo"], "reward: the demo rule"),
    (["--remote_rm_url", "r.py"], "reward: reward_func() of --remote_rm_url r.py"),
    (["--remote_rm_url", "https://u:secret@rm/score?key=1"], "reward: the HTTP endpoint --remote_rm_url https://<redacted>@rm/score?<redacted>"),
    (["--compute_score", "s.py"], "reward: compute_score() of --compute_score s.py (verl's convention), per sample"),
    (["--compute_score", "builtin"], "reward: rlrun's versions of verl's rule scores"),
    (["--reward_pretrain", "rm"], "reward: the reward model --reward_pretrain rm"),
    (["--agent_func_path", "agent.py"], "reward: the episodes of the agent --agent_func_path agent.py"),
])
def test_reward_source_in_one_line(args, text) -> None:
    line = describe_reward(parse_args(args).config)
    assert line.startswith(text) and "\n" not in line and "secret" not in line


def test_large_layout_in_one_line() -> None:
    assert describe_roles({"actor": range(0, 32), "ref": [0, 1, 2, 3, 8], "engine": [32, 33, 35]}) == \
        "actor ranks 0-31, ref 0-3,8, engine 32-33,35"


def test_supervised_evaluation_shows_in_the_step_lines() -> None:
    assert format_eval({"eval/loss": 0.69301, "eval/acc": 0.5, "eval/other": 1.0}) == "eval loss 0.6930 acc 0.500"
