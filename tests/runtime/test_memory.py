"""rlrun's glibc setting that returns freed large blocks to the system, measured in fresh processes (the allocator's
state is per process), and the per-rank peak-RSS line bench/memory.py reads."""

from __future__ import annotations

import subprocess
import sys

from rlrun.runtime.log import RankLogger
from rlrun.runtime.memory import REPORT_ENV, peak_rss_bytes, report_memory

# glibc's own malloc, not torch's tensors (whose allocation pattern varies with the build and environment): frees one
# 8 MiB block first (glibc's default then serves 8 MiB blocks from its heap), then allocates 40 such blocks, touching
# every page, with a 256 KiB block after each (from the heap under either setting: it pins the heap above it), frees the big ones, and prints the resident
# MiB kept.
_PROBE = """
import ctypes, ctypes.util, sys
from rlrun.runtime.memory import return_freed_memory
if sys.argv[1] == "fixed":
    assert return_freed_memory()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) / 1024
n = 8 * 2**20
libc.free(libc.malloc(n))
base = rss()
big, small = [], []
for _ in range(40):
    big.append(libc.malloc(n))
    ctypes.memset(big[-1], 1, n)
    small.append(libc.malloc(2**18))
for p in big:
    libc.free(p)
print(rss() - base)
"""


def _kept_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout.strip())


def test_freed_large_blocks_go_back_to_the_system():
    kept = _kept_mib("fixed")
    assert kept < 40, f"{kept:.0f} MiB of 320 MiB freed stayed resident"
    default = _kept_mib("default")
    assert default > 4 * max(kept, 10), (default, kept)  # what the setting saves (glibc's dynamic threshold)


def test_the_memory_line_is_off_unless_asked(capsys, monkeypatch):
    assert peak_rss_bytes() > 10 * 2**20
    monkeypatch.delenv(REPORT_ENV, raising=False)
    report_memory(RankLogger(3), "start-up")
    assert capsys.readouterr().out == ""
    monkeypatch.setenv(REPORT_ENV, "1")
    report_memory(RankLogger(3), "start-up")
    assert "memory: rank 3 peak RSS after start-up" in capsys.readouterr().out
