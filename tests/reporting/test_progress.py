"""Progress on rank 0: a bar on a terminal, one line per logged step in a file (Slurm, redirected output)."""

from __future__ import annotations

import io
import json
import re

from rlrun.cli.parser import parse_args
from rlrun.reporting.metrics import MetricsSink
from rlrun.reporting.metrics import BarProgress, LineProgress, format_duration, format_step_line, make_progress

LINE = re.compile(r"^\[rlrun \d\d:\d\d:\d\d info\] ")


class FakeStream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 7.4, 59.6, 648, 3725, -3)] == ["0s", "7s", "1m00s", "10m48s", "1h02m05s", "0s"]


def test_step_line_by_hand() -> None:
    metrics = {"step": 12, "reward": 0.41234, "kl": 0.0031, "response_length": 87.25, "time/step": 9.0}
    line = format_step_line(12, 200, metrics, 3.41)
    # ETA = 3.41 s x 188 steps left = 641.08 s = 10m41s.
    assert line == "step 12/200 | reward 0.412 | kl 0.0031 | len 87.2 | 3.41 s/step | ETA 10m41s"
    evals = {"eval/reward": 0.5, "eval/pass@4": 0.75, "eval/response_length": 12.0, "eval/num_samples": 8.0}
    assert format_step_line(200, 200, {"reward": 1.0}, None, evals) == (
        "step 200/200 | reward 1.000 | eval reward 0.500 pass@4 0.750 len 12.0")


def test_non_tty_prints_one_line_per_step_with_eta() -> None:
    out, err = FakeStream(tty=False), FakeStream(tty=True)
    clock = iter([100.0, 104.0, 110.0]).__next__
    progress = LineProgress(10, 2, out, clock=clock, stamp=lambda: "12:01:02")
    progress.step(3, {"reward": 0.5})  # 4 s for 1 step, 7 left
    progress.step(4, {"reward": 0.25}, {"eval/reward": 0.125})  # 10 s for 2 steps, 6 left
    progress.eval(4, {"eval/reward": 0.125, "eval/pass@2": 0.5})
    assert out.getvalue().splitlines() == [
        "[rlrun 12:01:02 info] step 3/10 | reward 0.500 | 4.00 s/step | ETA 28s",
        "[rlrun 12:01:02 info] step 4/10 | reward 0.250 | 5.00 s/step | ETA 30s | eval reward 0.125",
        "[rlrun 12:01:02 info] eval reward 0.125 pass@2 0.500 (at step 4/10)",
    ]
    assert "\r" not in out.getvalue() and err.getvalue() == ""


def test_mode_choice() -> None:
    tty, file = FakeStream(tty=True), FakeStream(tty=False)
    assert isinstance(make_progress(5, 0, stdout=tty, stderr=tty, environ={}), BarProgress)
    for out, err in ((file, tty), (tty, file), (file, file)):
        assert isinstance(make_progress(5, 0, stdout=out, stderr=err, environ={}), LineProgress)
    # RLRUN_NO_PROGRESS=1 turns the bar off; lines (plain log output) stay.
    quiet = make_progress(5, 0, stdout=tty, stderr=tty, environ={"RLRUN_NO_PROGRESS": "1"})
    assert isinstance(quiet, BarProgress) and quiet.bar.disable
    assert isinstance(make_progress(5, 0, stdout=file, stderr=file, environ={"RLRUN_NO_PROGRESS": "1"}), LineProgress)


def test_bar_on_a_terminal_writes_no_lines() -> None:
    out, err = FakeStream(tty=True), FakeStream(tty=True)
    bar = BarProgress(4, 0, enabled=True)
    bar.bar.fp = err  # tqdm's stream: keep the test output clean
    bar.step(2, {"reward": 0.5})
    assert bar.bar.n == 2
    bar.close()
    assert out.getvalue() == ""


def test_sink_writes_eval_records_and_lines(tmp_path, monkeypatch, capsys) -> None:
    cfg = parse_args(["--save_path", str(tmp_path)]).config
    sink = MetricsSink(cfg.logging, cfg.checkpoint, total_steps=3, start_step=0)  # pytest's captured stdout is not a terminal: lines
    sink.log_eval(0, {"eval/reward": 0.25})
    sink.log({"step": 1, "reward": 0.5})
    sink.log({"step": 2, "reward": 0.75}, {"eval/reward": 0.5})
    sink.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 0, "eval/reward": 0.25}, {"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.75},
                       {"step": 2, "eval/reward": 0.5}]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(LINE.match(line) for line in lines)
    assert lines[0].endswith("eval reward 0.250 (at step 0/3)")
    assert "step 2/3 | reward 0.750" in lines[2] and lines[2].endswith("eval reward 0.500")
    # A resume from step 2 keeps the step-2 evaluation (and the one before training), drops nothing it needs.
    resumed = MetricsSink(cfg.logging, cfg.checkpoint, total_steps=3, start_step=2)
    resumed.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == records
    resumed = MetricsSink(cfg.logging, cfg.checkpoint, total_steps=3, start_step=1)
    resumed.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == records[:2]
