"""Console logging: rank 0 speaks for everyone; other ranks speak only about themselves."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass


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
