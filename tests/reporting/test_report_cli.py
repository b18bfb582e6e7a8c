"""`python -m rlrun.report RUN_DIR` and the curves PNG: summary.json and curves.png computed again from any run's
metrics.jsonl, keeping what only the run knew (its wall time, where it saved what)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO, subprocess_env
from rlrun import report
from rlrun.reporting.summary import PANELS, plot_curves

PNG = b"\x89PNG\r\n\x1a\n"


def _write_run(folder, records, name="metrics.jsonl"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder / name


PPO = [{"step": 0, "eval/reward": 0.2, "eval/response_length": 9.0},
       *({"step": s, "reward": 0.1 * s, "kl": 0.01 * s, "response_length": 10.0 + s, "time/step": 1.0}
         for s in range(1, 6)),
       {"step": 5, "eval/reward": 0.6, "eval/pass@4": 0.75, "eval/response_length": 12.0}]


def test_the_panels_follow_what_is_logged(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    assert plot_curves(PPO, str(tmp_path / "a.png")) is None
    assert (tmp_path / "a.png").read_bytes()[:8] == PNG
    assert plot_curves([{"step": 1, "loss": 1.0}, {"step": 1, "eval/loss": 1.2}], str(tmp_path / "b.png")) is None
    assert plot_curves([{"step": 1, "other": 1.0}], str(tmp_path / "c.png")) == "no curves logged yet"
    assert not (tmp_path / "c.png").exists()
    assert {title for title, _, _ in PANELS} >= {"reward", "KL", "response length", "step time (s)"}


def test_report_regenerates_summary_and_png_keeping_the_run_facts(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    _write_run(run, PPO)
    (run / "summary.json").write_text(json.dumps({"run": {"wall_s": 30.0, "outcome": "finished",
                                                          "saved": {"model": str(run)}}}))
    assert report.main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "summary: 5 steps" in out and "reward: first step 0.100, last step 0.500" in out
    assert "eval/pass@4: first 0.750 at step 5" in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["run"]["wall_s"] == 30.0 and summary["run"]["saved"]["model"] == str(run)
    assert summary["run"]["saved"]["curves"] == str(run / "curves.png")
    assert (run / "curves.png").read_bytes()[:8] == PNG


def test_report_takes_a_metrics_file_and_names_a_missing_one(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    path = _write_run(tmp_path / "logs", PPO, name="exp1.jsonl")
    assert report.main([str(path)]) == 0
    assert (tmp_path / "logs" / "exp1_summary.json").exists() and (tmp_path / "logs" / "exp1_curves.png").exists()
    assert report.main([str(tmp_path / "nothing")]) == 2
    assert "no " + str(tmp_path / "nothing" / "metrics.jsonl") in capsys.readouterr().err


def test_python_dash_m_rlrun_report(tmp_path) -> None:
    run = tmp_path / "run"
    _write_run(run, PPO)
    proc = subprocess.run([sys.executable, "-m", "rlrun.report", str(run)], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "summary: 5 steps" in proc.stdout and (run / "summary.json").exists()
