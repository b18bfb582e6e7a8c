"""rlrun.tinker's request loop on rank 0 (rlrun/tinker/job.py), without ranks: which queued requests run as one call.
The queue is filled before the loop looks, so nothing here depends on timing."""

from __future__ import annotations

import queue
from types import SimpleNamespace
from typing import Any, cast

import torch

from rlrun.tinker.calls import OptimStep, Sample, SampleParams
from rlrun.tinker.job import Serving, _merged
from rlrun.tinker.server import Pending, Result

PARAMS = SampleParams(max_tokens=8, temperature=1.0, top_p=1.0, stop_tokens=None, stop_strings=())


def pending(rid: str, call: Any) -> Pending:
    return Pending(rid, call, lambda part: Result())


def serving(*queued: Pending) -> Serving:
    front = SimpleNamespace(work=queue.Queue())
    for p in queued:
        front.work.put(p)
    return Serving(cast(Any, None), cast(Any, front), cast(Any, None), torch.device("cpu"), keepalive_s=5.0)


def test_a_wave_of_sample_requests_with_equal_settings_runs_as_one_call() -> None:
    wave = [pending(f"r{i}", Sample([[1, 2 + i]], [i], PARAMS)) for i in range(5)]
    other = pending("hot", Sample([[7]], [9], SampleParams(8, 0.5, 1.0, None, ())))  # other settings: its own call
    step = pending("step", OptimStep(cast(Any, None)))
    loop = serving(*wave, other, step)
    taken = loop._next(lambda: False)
    assert [p.request_id for p in taken] == ["r0", "r1", "r2", "r3", "r4"]
    merged = _merged(taken)
    assert isinstance(merged, Sample) and merged.prompts == [[1, 2 + i] for i in range(5)] and merged.keys == [0, 1, 2, 3, 4]
    assert [p.request_id for p in loop._next(lambda: False)] == ["hot"]  # held back, runs next, alone (step follows)
    assert [p.request_id for p in loop._next(lambda: False)] == ["step"]
    assert loop._next(lambda: True) == []  # a stop notice with nothing queued
