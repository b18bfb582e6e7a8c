"""Evaluation during training: metric definitions (hand-computed), config checks, and a 2-rank run."""

from __future__ import annotations

import json

import pytest
import torch

from rlrun.cli.parser import parse_args
from rlrun.rl.evaluation import TOTALS, finalize, local_totals, prompt_slice
from rlrun.plan.plan import check_eval
from rlrun.runtime.errors import ConfigError

from helpers import DEMO_3, run_rlrun, untimed


def test_local_totals_by_hand() -> None:
    # 2 prompts x 3 samples. Prompt means 0.5 and 0.2, maxima 1.0 and 0.6.
    rewards = torch.tensor([[1.0, 0.0, 0.5], [0.0, 0.6, 0.0]])
    lengths = torch.tensor([[4, 6, 8], [16, 16, 2]])
    truncated = torch.tensor([[False, False, False], [True, True, False]])
    t = local_totals(rewards, lengths, truncated)
    assert t.dtype == torch.float64 and t.shape == (TOTALS,)
    assert torch.allclose(t, torch.tensor([0.7, 1.6, 2.0, 52.0, 6.0, 2.0], dtype=torch.float64))


def test_finalize_sums_ranks_then_divides() -> None:
    # Rank 0: the two prompts above; rank 1: one prompt [1, 1, 0] (mean 2/3, max 1, lengths 3+3+3, none truncated);
    # rank 2 is not an engine rank (zeros).
    per_rank = torch.tensor([[0.7, 1.6, 2.0, 52.0, 6.0, 2.0], [2 / 3, 1.0, 1.0, 9.0, 3.0, 0.0], [0.0] * 6],
                            dtype=torch.float64)
    out = finalize(per_rank, 3)
    assert out == pytest.approx({
        "eval/reward": (0.7 + 2 / 3) / 3,  # 0.45556: the mean of all 9 rewards (4.1 / 9), as pass1 in OpenRLHF
        "eval/pass@3": 2.6 / 3,  # mean over prompts of the best of 3
        "eval/response_length": 61 / 9,
        "eval/truncated_rate": 2 / 9,
        "eval/num_samples": 9.0,
    })
    assert out["eval/reward"] == pytest.approx(4.1 / 9)


def test_single_sample_logs_no_pass_at_n() -> None:
    t = local_totals(torch.tensor([[0.25], [0.75]]), torch.tensor([[1], [3]]), torch.tensor([[False], [False]]))
    out = finalize(t.view(1, -1), 1)
    assert out == pytest.approx({"eval/reward": 0.5, "eval/response_length": 2.0, "eval/truncated_rate": 0.0,
                                 "eval/num_samples": 2.0})


def test_empty_share_is_zero() -> None:
    empty = torch.zeros(0, 4)
    assert torch.equal(local_totals(empty, empty, empty), torch.zeros(TOTALS, dtype=torch.float64))


@pytest.mark.parametrize("num_prompts, slots, expected", [
    (3, 2, [range(0, 1), range(1, 3)]),
    (4, 2, [range(0, 2), range(2, 4)]),
    (1, 3, [range(0, 0), range(0, 0), range(0, 1)]),
    (7, 3, [range(0, 2), range(2, 4), range(4, 7)]),
])
def test_prompt_slice_covers_every_prompt_once(num_prompts: int, slots: int, expected: list[range]) -> None:
    parts = [range(num_prompts)[prompt_slice(num_prompts, slots, s)] for s in range(slots)]
    assert parts == expected


def test_eval_needs_a_function_reward() -> None:
    cfg = parse_args(["--eval_dataset", "x.jsonl", "--eval_steps", "5", "--reward_pretrain", "/rm"]).config
    with pytest.raises(ConfigError, match=r"--eval_dataset x.jsonl: evaluation rewards responses .* --remote_rm_url"):
        check_eval(cfg)
    cfg = parse_args(["--eval_dataset", "x.jsonl", "--eval_steps", "5", "--reward_pretrain", "/rm",
                      "--remote_rm_url", "r.py"]).config
    assert check_eval(cfg) == []


@pytest.mark.parametrize("args, needle", [
    (["--eval_steps", "0"], "--eval_steps 0 must be a positive step count, or -1"),
    (["--eval_steps", "2", "--eval_n_samples_per_prompt", "0"], "--eval_n_samples_per_prompt 0 must be >= 1"),
    (["--eval_steps", "2", "--eval_temperature", "0"], "--eval_temperature 0.0 must be > 0"),
])
def test_eval_value_errors(args: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        check_eval(parse_args(["--eval_dataset", "x.jsonl", *args]).config)


def test_eval_warnings_when_nothing_would_run() -> None:
    assert check_eval(parse_args(["--eval_steps", "3"]).config) == [
        "--eval_steps 3 has no effect without --eval_dataset; no evaluation will run"]
    assert "no evaluation will run" in check_eval(parse_args(["--eval_dataset", "x.jsonl"]).config)[0]
    assert check_eval(parse_args([]).config) == []


def test_eval_defaults_match_openrlhf() -> None:
    cfg = parse_args([]).config
    ev, lg = cfg.eval, cfg.logging
    # OpenRLHF 0.11.2 cli/train_ppo_ray.py: --eval.temperature 0.6, --eval.n_samples_per_prompt 4, --eval.steps -1.
    assert (ev.eval_temperature, ev.eval_n_samples_per_prompt, lg.eval_steps, ev.eval_dataset) == (0.6, 4, -1, None)
    assert not parse_args(["--eval_temperature", "0.7", "--eval_dataset", "d.jsonl"]).ignored





@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_rank_run_logs_eval_and_keeps_training_identical(tmp_path, demo_3) -> None:
    eval_file = tmp_path / "eval.jsonl"
    # 3 prompts over 2 engine ranks: an uneven share (1 + 2).
    eval_file.write_text("".join(json.dumps({"prompt": p, "label": lab}) + "\n" for p, lab in
                                 [("Write some digits:", "digits"), ("Write some letters:", "letters"),
                                  ("Write digits:", "digits")]))
    evals = ["--eval_dataset", str(eval_file), "--input_key", "prompt", "--label_key", "label", "--eval_steps", "2",
             "--eval_before_train", "--eval_n_samples_per_prompt", "2"]
    with_eval = run_rlrun(2, DEMO_3 + evals, tmp_path / "a")
    assert with_eval.returncode == 0, with_eval.output[-3000:]
    steps = [(r["step"], "eval/reward" in r) for r in with_eval.metrics]
    assert steps == [(0, True), (1, False), (2, False), (2, True), (3, False)]
    for record in (r for r in with_eval.metrics if "eval/reward" in r):
        assert record["eval/num_samples"] == 6.0
        assert 0.0 <= record["eval/reward"] <= record["eval/pass@2"] <= 1.0
        assert 0 < record["eval/response_length"] <= 16
        assert "reward" not in record
    # Output is not a terminal: one line per step, the evaluation on step 2's line.
    assert "step 1/3 | reward" in with_eval.output
    assert "eval reward" in next(line for line in with_eval.output.splitlines() if "step 2/3 |" in line)
    assert "eval reward" in with_eval.output.split("step 1/3")[0]  # the evaluation before training

    without = demo_3[1]  # the same run without the evaluations
    assert without.returncode == 0, without.output[-3000:]
    train_only = [r for r in with_eval.metrics if "eval/reward" not in r]
    assert untimed(train_only) == untimed(without.metrics)
