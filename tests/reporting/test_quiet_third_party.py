"""Third-party noise off a terminal (rlrun.runtime.log.quiet_third_party): no Hugging Face progress bars, and
transformers' LOAD REPORT table as one line. Checked in a child process (the switches are process-wide)."""

from __future__ import annotations

import io
import subprocess
import sys

from helpers import REPO, subprocess_env
from rlrun.runtime.log import one_line_load_report, quiet_third_party

TABLE = ("\x1b[1mQwen2ForSequenceClassification LOAD REPORT\x1b[0m from: /m\n"
         "Key            | Status     | \n---------------+------------+-\n"
         "lm_head.weight | UNEXPECTED | \nscore.weight   | MISSING    | \n\nNotes:\n- UNEXPECTED:\tcan be ignored ...\n"
         "- MISSING:\tthose params were newly initialized ...")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_load_report_becomes_one_line() -> None:
    assert one_line_load_report(TABLE) == ("Qwen2ForSequenceClassification LOAD REPORT from: /m: 1 unexpected "
                                           "(lm_head.weight); 1 missing (score.weight) (missing weights are newly "
                                           "initialised)")
    assert one_line_load_report("some other warning") == "some other warning"


def test_rank_0_on_a_terminal_keeps_everything() -> None:
    assert quiet_third_party(0, Terminal()) is False


CHILD = r"""
import sys
import transformers
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
from rlrun.models.tiny import tiny_model_config
from rlrun.runtime.log import quiet_third_party
out = sys.argv[1]
AutoModelForCausalLM.from_config(tiny_model_config()).save_pretrained(out)
assert quiet_third_party(0)  # stderr is a pipe here
AutoModelForSequenceClassification.from_pretrained(out, num_labels=1)
import subprocess  # a process this one starts, drawing with tqdm directly (as transformers' GGUF dequantisation does)
subprocess.run([sys.executable, "-c", "from tqdm.auto import tqdm; list(tqdm(range(3), desc='direct tqdm'))"], check=True)
"""


def test_off_a_terminal_no_bars_and_one_line_reports(tmp_path) -> None:
    env = subprocess_env()
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    env.pop("TQDM_DISABLE", None)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "lm")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = proc.stderr.split("Writing model shards")[-1]  # the save before quiet_third_party may draw its bar
    reports = [line for line in after.splitlines() if "LOAD REPORT" in line]
    assert len(reports) == 1 and "1 missing (score.weight)" in reports[0], proc.stderr
    assert "Loading weights" not in after and "| MISSING" not in after and "\r" not in after, after
    assert "direct tqdm" not in after, after
