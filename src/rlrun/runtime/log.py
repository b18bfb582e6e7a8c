"""Console logging: rank 0 speaks for everyone; other ranks speak only about themselves. Third-party progress bars
and Hugging Face load reports are silenced or made one line where nobody watches a terminal (quiet_third_party)."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import TextIO


@dataclass
class RankLogger:
    rank: int

    def _emit(self, level: str, message: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        stream = sys.stderr if level != "info" else sys.stdout
        # One write, newline included: print() writes the text and the newline separately, and on an unbuffered
        # stream shared by several ranks (torchrun's, Slurm's) another rank's line could land between the two,
        # gluing two ranks' lines into one (seen in CI).
        stream.write(f"[rlrun {stamp} {level}] {message}\n")
        stream.flush()

    def info_once(self, message: str) -> None:
        if self.rank == 0:
            self._emit("info", message)

    def warning_once(self, message: str) -> None:
        if self.rank == 0:
            self._emit("warning", message)

    def error_once(self, message: str) -> None:
        if self.rank == 0:
            self._emit("error", message)

    def rank_warning(self, message: str) -> None:
        self._emit("warning", f"rank {self.rank}: {message}")

    def rank_error(self, message: str) -> None:
        self._emit("error", f"rank {self.rank}: {message}")


# After an error every rank hits alike, ranks other than 0 wait this long before exiting: torchrun stops
# all workers as soon as one fails, so a rank 1 that exits first could kill rank 0 before it prints.
ERROR_GRACE_S = 10.0


def let_rank0_report(rank: int) -> None:
    """Wait (normally cut short: the launcher stops this rank once rank 0 has reported and exited)."""
    if rank != 0:
        time.sleep(ERROR_GRACE_S)


def get_logger(rank: int) -> RankLogger:
    return RankLogger(rank)


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or not a real stream
        return False


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_REPORT_ROW = re.compile(r"^(\S+)\s*\|\s*(UNEXPECTED|MISSING|MISMATCH|CONVERSION)\b", re.M)


def one_line_load_report(text: str, shown: int = 3) -> str:
    """transformers' multi-line `LOAD REPORT` table (keys missing from or unexpected in a checkpoint) as one line:
    'Qwen2ForSequenceClassification LOAD REPORT from: /m: 1 unexpected (lm_head.weight); 1 missing (score.weight)
    (missing weights are newly initialised)'. Any other text is returned unchanged."""
    plain = _ANSI.sub("", text)
    if "LOAD REPORT" not in plain:
        return text
    by_status: dict[str, list[str]] = {}
    for key, status in _REPORT_ROW.findall(plain):
        by_status.setdefault(status.lower(), []).append(key)
    parts = [
        f"{len(keys)} {status} ({', '.join(keys[:shown])}{', ...' if len(keys) > shown else ''})"
        for status, keys in by_status.items()
    ]
    head = plain.strip().splitlines()[0].strip()
    found = "; ".join(parts) if parts else "the table is shown on a terminal"
    return f"{head}: {found} (missing weights are newly initialised)"


class _OneLineLoadReports(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        short = one_line_load_report(message)
        if short is not message:
            record.msg, record.args = short, None
        return True


def quiet_third_party(rank: int, stream: TextIO | None = None) -> bool:
    """Off a terminal (`stream`, default stderr, is not a TTY) and on every rank but 0: no Hugging Face Hub or
    transformers progress bars (loading shards, writing shards, downloads: under Slurm they become endless
    carriage-return lines, one per rank), and transformers' LOAD REPORT table as one line. Also for the processes
    this one starts (HF_HUB_DISABLE_PROGRESS_BARS). HF_HUB_DISABLE_PROGRESS_BARS=0 keeps the bars. Returns
    whether it quietened anything."""
    if is_terminal(stream or sys.stderr) and rank == 0:
        return False
    if os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS", "").strip().lower() not in ("0", "false", "no", "off"):
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # read when huggingface_hub is imported (here or in a child)
        # tqdm's own default, for libraries that draw with it directly (transformers' GGUF dequantisation); tqdm reads
        # it when imported, so it reaches the processes this one starts, not a tqdm already imported here
        os.environ["TQDM_DISABLE"] = "1"
        # Already imported (every trainer has by now): switch them off in place. Looked up, not imported: this tier
        # depends on the standard library only.
        if (hub := sys.modules.get("huggingface_hub.utils")) is not None:
            hub.disable_progress_bars()
        if (hf_logging := sys.modules.get("transformers.utils.logging")) is not None:
            hf_logging.disable_progress_bar()  # transformers keeps its own switch beside the Hub's
    for handler in logging.getLogger("transformers").handlers:  # transformers' handler, once it is imported
        if not any(isinstance(f, _OneLineLoadReports) for f in handler.filters):
            handler.addFilter(_OneLineLoadReports())
    return True
