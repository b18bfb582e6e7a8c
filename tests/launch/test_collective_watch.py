"""A collective stuck for nearly its group's timeout becomes one failure line naming the collective and the rlrun
group, with the flight recorder's dump beside it (NCCL's watchdog would SIGABRT the rank instead; it only runs on
GPUs, where bench/gpu's nccl_timeout check exercises it). Here the same watch reads the gloo flight recorder of two
real processes: rank 1 never joins rank 0's all_reduce."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rlrun.launch.dist import stuck, warning_margin

NOW = 1_000_000 * 10**9


def _entry(seq: int, age_s: float, **extra) -> dict:
    return {"collective_seq_id": seq, "profiling_name": "nccl:all_reduce", "process_group": ("3", "actor"),
            "time_created_ns": NOW - int(age_s * 1e9), "timeout_ms": 60_000, "input_sizes": [[4, 8]],
            "state": "started", "retired": False, "is_p2p": False} | extra


def test_the_oldest_unfinished_collective_past_its_bound_is_named() -> None:
    trace = {"pg_config": {"3": {"name": "3", "desc": "actor", "ranks": "[0, 1, 2, 3]"}},
             "entries": [_entry(7, 90, retired=True), _entry(8, 80, state="completed"), _entry(9, 58),
                         _entry(10, 59, is_p2p=True), _entry(11, 10)]}
    found = stuck(trace, NOW, early_s=3)
    assert found is not None and (found.seq, found.group, found.ranks, found.op) == (9, "actor", "[0, 1, 2, 3]",
                                                                                    "nccl:all_reduce")
    assert "nccl:all_reduce #9 on group actor (ranks [0, 1, 2, 3])" in found.describe()
    assert stuck(trace, NOW, early_s=1) is None  # 58 s of 60: not yet
    assert stuck({"entries": []}, NOW, 3) is None
    as_text = {"entries": [{k: str(v) if isinstance(v, int) and not isinstance(v, bool) else v
                            for k, v in _entry(12, 59).items()}]}  # numbers stringified, as some releases dump them
    assert stuck(as_text, NOW, early_s=3).seq == 12


def test_the_watch_fires_before_the_timeout_and_often_enough_to_win() -> None:
    for timeout in (5, 60, 300, 1800):
        early, poll = warning_margin(timeout)
        assert 0 < early < timeout and poll * 3 <= early + 1e-9


def test_a_collective_one_rank_never_joins_is_one_line_naming_it(tmp_path: Path) -> None:
    from helpers import free_port  # not at the top: the ranks run this file as __main__

    port = free_port()
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE="200", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    start = time.monotonic()
    try:
        out, _ = procs[0].communicate(timeout=60)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 1, out
    lines = [line for line in out.splitlines() if "CollectiveTimeout" in line]
    assert len(lines) == 1 and "collective gloo:all_reduce #2 on group actor" in lines[0], out
    assert "never joined" in lines[0] and "JOINED" not in out  # the watch, not gloo's own timeout, ended it
    dump = tmp_path / "stuck_rank_0.json"
    assert f"flight recorder dump: {dump}" in lines[0]
    assert any(e["collective_seq_id"] == 2 for e in json.loads(dump.read_text())["entries"])
    assert time.monotonic() - start < 45


def _rank_main(rank: int, port: int, outdir: Path) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from rlrun.launch.dist import CollectiveWatch, flight_recorder_dump
    from rlrun.runtime.phases import report_fatal

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    group = dist.new_group([0, 1], timeout=timedelta(seconds=6), group_desc="actor")
    dist.all_reduce(torch.ones(2), group=group)  # collective #1 completes
    if rank == 1:
        time.sleep(60)  # never joins #2
        return
    dump = flight_recorder_dump("gloo")
    assert dump is not None
    CollectiveWatch(dump, 6, str(outdir / "stuck_rank_0.json"), report_fatal).start()
    try:
        dist.all_reduce(torch.ones(2), group=group)
    except RuntimeError:
        print("JOINED: gloo's own timeout came first")
        time.sleep(10)


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))


def test_a_recorder_that_cannot_be_read_is_said_once_and_never_fatal() -> None:
    import threading

    from rlrun.launch.dist import CollectiveWatch

    warned, reported, polls = [], [], threading.Event()
    calls = [0]

    def broken() -> str:
        calls[0] += 1
        if calls[0] >= 4:
            polls.set()
        raise TypeError("_dump_nccl_trace_json() takes 3 arguments")

    watch = CollectiveWatch(broken, 3.0, None, reported.append, warn=warned.append).start()
    assert polls.wait(10)
    watch.stop()
    assert len(warned) == 1 and "cannot read torch's flight recorder (TypeError" in warned[0] and not reported
