"""An NCCL collective that never completes becomes rlrun's one failure line, not a watchdog abort.

NCCL's watchdog ends a rank whose collective outlives the group's timeout with SIGABRT and a C++ message (and,
with the flight recorder on, a dump): no Python code runs, so the run's failure line never comes. This thread reads
PyTorch's flight recorder (the last collectives of every group; on for NCCL runs, `launch.dist`) a little before
that timeout, and when a collective has been in flight for nearly its group's timeout it writes the recorder's dump
beside the run and hands the run's failure reporter one error naming the collective, its sequence number and the
rlrun group (the `group_desc` given in `launch.groups`). The rank then leaves as every failing rank does.
The cost of firing early: a collective that would have finished in the last `early_s` seconds fails instead.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlrun.runtime.errors import RlrunError


class CollectiveTimeout(RlrunError):
    """A collective stayed in flight for (nearly) its group's timeout: some rank of the group never joined it."""


@dataclass(frozen=True)
class InFlight:
    """One collective of the flight recorder that has not completed."""

    op: str  # the recorder's profiling name, e.g. "nccl:all_reduce"
    seq: int  # the group's collective sequence number (equal on every rank that joined it)
    group: str  # rlrun's name for the group (its group_desc), else torch's group name
    ranks: str  # the group's global ranks as the recorder gives them ("" when unknown)
    sizes: list[Any]
    age_s: float
    timeout_s: float

    def describe(self) -> str:
        on = f"group {self.group}" + (f" (ranks {self.ranks})" if self.ranks else "")
        return (f"collective {self.op} #{self.seq} on {on}, input sizes {self.sizes}, has waited {self.age_s:.0f} s of "
                f"its {self.timeout_s:g} s timeout: a rank of that group never joined it (that rank's own line, or its "
                "stack dump, says where it is)")


def stuck(trace: dict[str, Any], now_ns: int, early_s: float) -> InFlight | None:
    """The oldest collective in `trace` (a flight-recorder dump, parsed JSON) that has not completed and has been in
    flight longer than its own timeout less `early_s`; None when there is none."""
    groups = trace.get("pg_config", {})
    # Numbers as numbers or strings: the JSON dump has stringified some fields in some torch releases.
    for entry in sorted(trace.get("entries", []), key=lambda e: int(e.get("time_created_ns", 0))):
        if entry.get("retired") in (True, "true") or entry.get("state") == "completed" or entry.get("is_p2p") in (
                True, "true"):
            continue
        timeout_s = float(entry.get("timeout_ms", 0)) / 1000
        age_s = (now_ns - int(entry.get("time_created_ns", now_ns))) / 1e9
        if timeout_s <= 0 or age_s < timeout_s - early_s:
            continue
        name, desc = (tuple(entry.get("process_group", ())) + ("", ""))[:2]
        ranks = str(groups.get(str(name), {}).get("ranks", ""))
        return InFlight(op=str(entry.get("profiling_name", "?")), seq=int(entry.get("collective_seq_id", -1)),
                        group=str(desc or name), ranks="" if ranks == "[]" else ranks,
                        sizes=entry.get("input_sizes", []), age_s=age_s, timeout_s=timeout_s)
    return None


def warning_margin(timeout_s: float) -> tuple[float, float]:
    """(early_s, poll_s): how long before the group's timeout the watch fires, and how often it looks (three looks
    inside the margin, so it fires before NCCL's watchdog does)."""
    early_s = min(15.0, max(0.5, 0.05 * timeout_s))
    return early_s, early_s / 3


class CollectiveWatch:
    """A daemon thread polling `dump()` (the flight recorder as JSON) every `poll_s`; the first stuck collective
    is written to `dump_path` and goes to `report` (which must end the process). A recorder that cannot be read
    is said once through `warn` (NCCL's own watchdog then stays the only bound), never fatal."""

    def __init__(self, dump: Callable[[], str | bytes], timeout_s: float, dump_path: str | None,
                 report: Callable[[BaseException], None], warn: Callable[[str], None] | None = None) -> None:
        self.dump, self.dump_path, self.report, self.warn = dump, dump_path, report, warn
        self.early_s, self.poll_s = warning_margin(timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlrun-collective-watch", daemon=True)

    def start(self) -> CollectiveWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                raw = self.dump()
                found = stuck(json.loads(raw), time.time_ns(), self.early_s)
            except Exception as exc:  # noqa: BLE001 - a recorder that cannot be read must not end a healthy run
                if self.warn is not None:
                    self.warn(f"the collective watch cannot read torch's flight recorder ({type(exc).__name__}: "
                              f"{str(exc)[:160]}); a stuck collective ends in NCCL's own watchdog abort instead")
                    self.warn = None
                continue
            if found is not None and not self._stop.is_set():
                self.report(CollectiveTimeout(found.describe() + self._save(raw)))
                return

    def _save(self, raw: str | bytes) -> str:
        if self.dump_path is None:
            return ""
        try:
            os.makedirs(os.path.dirname(self.dump_path) or ".", exist_ok=True)
            with open(self.dump_path, "wb") as out:
                out.write(raw.encode() if isinstance(raw, str) else raw)
        except OSError as exc:
            return f"; the flight recorder's dump could not be written ({exc})"
        return f"; flight recorder dump: {self.dump_path}"


def flight_recorder_dump(backend: str) -> Callable[[], str | bytes] | None:
    """This process's flight-recorder dump for `backend` as JSON (in-flight collectives only), or None when torch has
    none."""
    from torch._C import _distributed_c10d as c10d  # noqa: PLC0415 - private API, looked up only where used

    fn = getattr(c10d, "_dump_nccl_trace_json" if "nccl" in backend else "_dump_fr_trace_json", None)
    if fn is None:
        return None
    return lambda: fn(True, True)
