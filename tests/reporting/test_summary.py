"""The end-of-run summary: computed from metric records alone (rlrun.reporting.summary), written and printed by the
sink at the end of a run, also after one that stopped early (rlrun.reporting.metrics)."""

from __future__ import annotations

import json

import pytest

from rlrun.cli.parser import parse_args
from rlrun.reporting.metrics import MetricsSink
from rlrun.reporting.summary import format_summary, outputs_beside, read_metrics, summarize
from rlrun.runtime.log import RankLogger

# Three PPO steps (one skipped update by step 3), an evaluation before training and one after step 2.
RECORDS = [
    {"step": 0, "eval/reward": 0.25, "eval/pass@4": 0.5},
    {"step": 1, "reward": 0.1, "kl": 0.0, "tokens_per_s": 100.0, "time/step": 2.0, "time/generate": 1.0,
     "time/train": 1.0, "actor/skipped_steps": 0.0},
    {"step": 2, "reward": 0.6, "kl": 0.01, "tokens_per_s": 300.0, "time/step": 1.0, "time/generate": 0.5,
     "time/train": 0.5, "actor/skipped_steps": 0.0},
    {"step": 2, "eval/reward": 0.75, "eval/pass@4": 1.0},
    {"step": 3, "reward": 0.4, "kl": None, "tokens_per_s": 200.0, "time/step": 1.0, "time/generate": 0.5,
     "time/train": 0.5, "actor/skipped_steps": 1.0},
]


def test_summary_numbers() -> None:
    s = summarize(RECORDS, "m.jsonl")
    assert (s["steps"], s["logged_steps"], s["evaluations"]) == (3, 3, 2)
    assert s["time"]["steps_s"] == 4.0 and s["time"]["per_step_s"] == pytest.approx(4 / 3)
    assert s["time"]["phases_s"] == {"generate": 2.0, "train": 2.0}
    assert s["tokens_per_s"] == pytest.approx((100 * 2 + 300 + 200) / 4)  # generated tokens / step time
    assert s["curves"]["reward"] == {"first": 0.1, "first_step": 1, "last": 0.4, "last_step": 3, "best": 0.6,
                                     "best_step": 2, "points": 3}
    assert s["curves"]["eval/reward"]["first_step"] == 0 and s["curves"]["eval/reward"]["best"] == 0.75
    assert s["curves"]["eval/pass@4"]["last"] == 1.0
    assert s["skipped_updates"] == 1


def test_loss_is_best_when_lowest_and_empty_records_summarise() -> None:
    s = summarize([{"step": 1, "loss": 2.0, "acc": 0.5}, {"step": 2, "loss": 1.0, "acc": 0.4},
                   {"step": 3, "loss": 1.5, "acc": 0.7}])
    assert (s["curves"]["loss"]["best"], s["curves"]["loss"]["best_step"]) == (1.0, 2)
    assert (s["curves"]["acc"]["best"], s["curves"]["acc"]["best_step"]) == (0.7, 3)
    empty = summarize([])
    assert empty["steps"] == 0 and empty["curves"] == {} and format_summary(empty) == ["summary: 0 steps"]


def test_summary_lines() -> None:
    s = summarize(RECORDS)
    s["run"] = {"wall_s": 65.0, "outcome": "finished", "saved": {"model": "out", "config": "out/config.yaml"}}
    lines = format_summary(s)
    assert lines[0] == ("summary: 3 steps, 4.0s in steps (1.33 s/step: generate 50%, train 50%), 175 generated "
                        "tokens/s; 1m05s from start-up to the end")
    assert lines[1] == ("reward: first step 0.100, last step 0.400, best 0.600 at step 2 (3 steps; 1 updates skipped "
                        "for non-finite gradients)")
    assert lines[2] == "eval/reward: first 0.250 at step 0, last 0.750 at step 2, best 0.750 at step 2"
    assert lines[-1] == "saved: model out, config out/config.yaml"
    s["run"]["outcome"] = "stopped before the end"
    assert format_summary(s)[0].endswith("(stopped before the end)")


def test_outputs_beside_the_metrics_file(tmp_path) -> None:
    assert outputs_beside("run/metrics.jsonl") == ("run/summary.json", "run/curves.png")
    assert outputs_beside("logs/exp1.jsonl") == ("logs/exp1_summary.json", "logs/exp1_curves.png")
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew')  # the last line cut short by a crash
    assert read_metrics(str(path)) == [{"step": 1, "reward": 0.5}]


def _sink(tmp_path):
    cfg = parse_args(["--save_path", str(tmp_path)]).config
    sink = MetricsSink(cfg.logging, cfg.checkpoint, total_steps=3, start_step=0)
    for record in RECORDS:
        if any(k.startswith("eval/") for k in record):
            sink.log_eval(record["step"], {k: v for k, v in record.items() if k != "step"})
        else:
            sink.log(record)
    return sink


def test_finish_writes_and_prints_the_summary(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    sink = _sink(tmp_path)
    capsys.readouterr()
    sink.finish(RankLogger(0), {"model": str(tmp_path)}, wall_s=12.0)
    out = capsys.readouterr().out
    assert "reward: first step 0.100, last step 0.400" in out and f"curves {tmp_path / 'curves.png'}" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run"]["outcome"] == "finished" and summary["run"]["wall_s"] == 12.0
    assert summary["run"]["saved"]["model"] == str(tmp_path)
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sink.close()  # the failure path may close it again: nothing happens
    assert json.loads((tmp_path / "summary.json").read_text())["run"]["outcome"] == "finished"


def test_a_run_that_stops_early_still_leaves_its_summary(tmp_path, capsys) -> None:
    sink = _sink(tmp_path)
    sink.close()  # what the failure path (rlrun.launch.failures.fail_and_exit) calls
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run"]["outcome"] == "stopped before the end" and summary["steps"] == 3


def test_without_matplotlib_one_warning_and_the_summary(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.backends.backend_agg", None)  # import fails
    sink = _sink(tmp_path)
    capsys.readouterr()
    sink.finish(RankLogger(0), {"model": str(tmp_path)}, wall_s=1.0)
    captured = capsys.readouterr()
    warnings = captured.err.strip().splitlines()
    assert len(warnings) == 1 and "no curves plotted: matplotlib is not installed" in warnings[0]
    assert f"python -m rlrun.report {tmp_path}" in warnings[0]
    assert (tmp_path / "summary.json").exists() and not (tmp_path / "curves.png").exists()
    assert "curves" not in json.loads((tmp_path / "summary.json").read_text())["run"]["saved"]
