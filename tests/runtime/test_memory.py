"""rlrun's glibc setting that returns freed large blocks to the system, measured in fresh processes (the allocator's
state is per process), and the per-rank peak-RSS line bench/memory.py reads."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from rlrun.runtime.log import RankLogger
from rlrun.runtime.memory import REPORT_ENV, peak_rss_bytes, report_memory

# glibc's own malloc, not torch's tensors (whose allocation pattern varies with the build and environment): frees
# one block first (glibc's default then serves blocks of its size from its heap), then allocates `count` such blocks,
# touching every page, with a 64 KiB block after each (from the heap under either setting: it pins the heap above
# it), frees the big ones, and prints the resident MiB kept.
_PROBE = """
import contextlib, ctypes, ctypes.util, sys
from rlrun.runtime.memory import return_freed_memory, reuse_heap
if sys.argv[1] in ("fixed", "decode"):
    assert return_freed_memory()
decoding = reuse_heap() if sys.argv[1] == "decode" else contextlib.nullcontext()
decoding.__enter__()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) / 1024
n, count = int(sys.argv[2]), int(sys.argv[3])
libc.free(libc.malloc(n))
base = rss()
big, small = [], []
for _ in range(count):
    big.append(libc.malloc(n))
    ctypes.memset(big[-1], 1, n)
    small.append(libc.malloc(2**16))
for p in big:
    libc.free(p)
print(rss() - base)
decoding.__exit__(None, None, None)
print(rss() - base)
"""


def _kept_mib(mode: str, block: int = 8 * 2**20, count: int = 40) -> float:
    return _kept_in_and_after(mode, block, count)[1]


def _kept_in_and_after(mode: str, block: int = 8 * 2**20, count: int = 40) -> tuple[float, float]:
    """The resident MiB kept of the freed blocks: right after the frees, and once `mode`'s block is left."""
    out = subprocess.run([sys.executable, "-c", _PROBE, mode, str(block), str(count)], capture_output=True, text=True,
                         timeout=120, check=True)
    inside, after = map(float, out.stdout.split())
    return inside, after


def test_freed_large_blocks_go_back_to_the_system():
    kept = _kept_mib("fixed")
    assert kept < 40, f"{kept:.0f} MiB of 320 MiB freed stayed resident"
    default = _kept_mib("default")
    assert default > 4 * max(kept, 10), (default, kept)  # what the setting saves (glibc's dynamic threshold)
    # A ZeRO-3 block's k/v projections and a micro-batch's activations are blocks of this size (bench/README.md).
    kept = _kept_mib("fixed", block=512 * 2**10, count=160)
    assert kept < 20, f"{kept:.0f} MiB of 80 MiB freed in 512 KiB blocks stayed resident"


def test_decoding_reuses_the_heap_and_returns_it_after():
    """Phase.GENERATE and EVAL run inside reuse_heap: freed blocks stay in the heap for the next token's tensors
    (glibc's default behaviour: no fresh pages to fault in), and leaving it trims them back to the system."""
    inside, after = _kept_in_and_after("decode")
    assert inside > 200, f"only {inside:.0f} MiB of 320 MiB freed stayed in the heap while decoding"
    assert after < 40, f"{after:.0f} MiB of 320 MiB freed stayed resident after decoding"


def test_the_memory_line_is_off_unless_asked(capsys, monkeypatch):
    assert peak_rss_bytes() > 10 * 2**20
    monkeypatch.delenv(REPORT_ENV, raising=False)
    report_memory(RankLogger(3), "start-up")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv(REPORT_ENV, "1")
    report_memory(RankLogger(3), "start-up")
    assert "memory: rank 3 peak RSS after start-up" in capsys.readouterr().out


_PHASES = """
import os, sys
os.environ["RLRUN_REPORT_MEMORY"] = "1"
from rlrun.runtime.phases import Phase, PhaseTracker
from rlrun.runtime.log import RankLogger
from rlrun.runtime.memory import PHASE_PEAKS, report_memory
phase = PhaseTracker(0, hang_after_s=60)
with phase(Phase.GENERATE, 0):
    big = bytearray(160 * 2**20)  # zero pages: touch them so they are resident
    for i in range(0, len(big), 4096):
        big[i] = 1
    del big
with phase(Phase.SCORE, 0):
    small = bytearray(16 * 2**20)
    for i in range(0, len(small), 4096):
        small[i] = 1
    del small
report_memory(RankLogger(0), "training")
"""


def test_the_memory_line_gives_each_phase_its_own_host_peak():
    """A real process: a phase's peak RSS is its own, not what an earlier phase reached (VmHWM is reset where a
    phase starts), while the whole run's peak stays the largest."""
    out = subprocess.run([sys.executable, "-c", _PHASES], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**18)}).stdout
    found = re.search(r"peak RSS after training (\d+) MiB \(generate (\d+), score (\d+) MiB\)", out)
    assert found, out
    overall, generate, score = map(int, found.groups())
    assert generate >= score + 120 and overall >= generate, out
