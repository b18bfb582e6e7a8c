"""Phase tracking, a hang watchdog, and opt-in fault injection for failure tests.

The watchdog: if one phase runs longer than the collective timeout allows, every thread's
Python stack is written to stderr and the process exits non-zero (a hung rank never outlives
its peers). Fault injection: RLRUN_FAULT="phase:step:rank[:kill|raise]" makes that rank SIGKILL
itself (or raise) when it reaches the phase at that step (0-based), on the first attempt only,
so an elastic restart can recover. Nothing happens when the variable is unset.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


class InjectedFault(Exception):
    """Raised by RLRUN_FAULT=...:raise."""


@dataclass
class PhaseTracker:
    rank: int
    hang_after_s: float
    phase: str = "startup"
    step: int = -1

    @contextmanager
    def __call__(self, phase: str, step: int) -> Iterator[None]:
        self.phase, self.step = phase, step
        faulthandler.dump_traceback_later(self.hang_after_s, exit=True, file=sys.stderr)
        try:
            maybe_inject(phase, step, self.rank)
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


def maybe_inject(phase: str, step: int, rank: int) -> None:
    spec = os.environ.get("RLRUN_FAULT")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    parts = spec.split(":")
    if parts[:3] != [phase, str(step), str(rank)]:
        return
    if (parts[3] if len(parts) > 3 else "kill") == "raise":
        raise InjectedFault(f"injected fault (RLRUN_FAULT={spec})")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
