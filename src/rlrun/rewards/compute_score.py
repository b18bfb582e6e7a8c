"""verl's per-sample reward convention: `compute_score(data_source, solution_str, ground_truth, extra_info)`.

A user's function comes from a .py file (verl's `custom_reward_function.path` / `.name`, rlrun's
`--compute_score FILE.py --compute_score_name NAME`); `--compute_score builtin` is rlrun's version of verl's
default scorer (rlrun.rewards.rules). As verl's NaiveRewardManager: every argument is passed by keyword,
`solution_str` is the response alone decoded without special tokens, a result is a number or a dict whose
"score" is the reward (its other numeric keys are logged as reward/<key> means).

Samples are scored in `--reward_workers` processes when that is above 1 (a pool started once, with the spawn
method: nothing of the trainer's state is forked), else in this process, where a function that relies on
`signal.alarm` still works. One call may take `--reward_timeout` seconds per batch; past it the run fails
naming the sample being scored.
"""

from __future__ import annotations

import atexit
import multiprocessing
import numbers
import signal
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from rlrun.rewards.reward_fn import RewardBatch, RewardFunction
from rlrun.runtime.errors import RewardError
from rlrun.runtime.phases import deadline
from rlrun.runtime.pyfile import import_file, one_line

BUILTIN = "builtin"
ScoreFn = Callable[..., Any]


def load_compute_score(path: str, name: str = "compute_score") -> ScoreFn:
    """`name` from the .py file `path` (verl's `file://` prefix accepted), or the built-in rule scores."""
    if path == BUILTIN:
        from rlrun.rewards.rules import default_compute_score  # noqa: PLC0415 - only --compute_score builtin needs it

        return default_compute_score
    module = import_file(
        path.removeprefix("file://"),
        "compute_score file",
        RewardError,
        f"{name}(data_source, solution_str, ground_truth, extra_info)",
    )
    fn = getattr(module, name, None)
    if not callable(fn):
        found = "is not callable" if hasattr(module, name) else "is missing"
        raise RewardError(
            f"compute_score file {path}: {name} {found}; define def {name}(data_source, solution_str, "
            "ground_truth, extra_info=None) returning a float or a dict with 'score' (or set "
            "--compute_score_name / custom_reward_function.name to the function's name)."
        )
    return fn


def _score(fn: ScoreFn, data_source: Any, solution: str, truth: Any, extra: Any) -> Any:
    return fn(data_source=data_source, solution_str=solution, ground_truth=truth, extra_info=extra)


_WORKER_FN: ScoreFn | None = None


def _worker_init(path: str, name: str) -> None:
    global _WORKER_FN
    # The time-limit notice (SIGUSR1, which Slurm sends to every process of the step: rlrun.run.preemption) is the
    # rank's to act on; SIGTERM keeps its default, since the pool stops a broken worker with it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    _WORKER_FN = load_compute_score(path, name)


def _worker_ready() -> bool:
    return _WORKER_FN is not None


def _worker_score(data_source: Any, solution: str, truth: Any, extra: Any) -> Any:
    assert _WORKER_FN is not None
    return _score(_WORKER_FN, data_source, solution, truth, extra)


class ComputeScore:
    """verl's compute_score applied to every sample of a batch; returns rlrun's {"rewards", "extra_logs"} shape."""

    def __init__(
        self, path: str, name: str = "compute_score", workers: int = 1, timeout_s: float | None = None
    ) -> None:
        self.path, self.name = path, name
        self.source = "built-in rule scores (verl's default_compute_score)" if path == BUILTIN else f"{path}:{name}"
        self._fn = load_compute_score(path, name)  # here too: a broken file fails at start-up, not at step 1
        self.workers, self.timeout_s = workers, timeout_s
        self._pool: ProcessPoolExecutor | None = None

    def _stuck(self, index: int, batch: RewardBatch) -> RewardError:
        tail = " ".join(batch.responses[index].split())[-120:]
        return RewardError(
            f"compute_score {self.source} did not return within --reward_timeout {self.timeout_s:g} s "
            f"on sample {index} of {len(batch.responses)} (data_source {batch.data_sources[index]!r}, "
            f"the response ends {tail!r}); make it faster (or bound its own waits), or raise "
            "--reward_timeout below --dist_timeout"
        )

    def _failed(self, index: int, batch: RewardBatch, exc: BaseException) -> RewardError:
        return RewardError(
            f"compute_score {self.source} raised {one_line(exc)} on sample {index} (data_source "
            f"{batch.data_sources[index]!r}, ground_truth {str(batch.labels[index])[:80]!r}); fix the "
            "function (call it on that sample by hand to reproduce)"
        )

    def __call__(self, batch: RewardBatch) -> dict[str, Any]:
        results = self._in_pool(batch) if self.workers > 1 else self._in_process(batch)
        return _as_rewards(results, self.source)

    def _in_process(self, batch: RewardBatch) -> list[Any]:
        current = [0]
        results = []
        with deadline(self.timeout_s, lambda: self._stuck(current[0], batch)):
            for i, sample in enumerate(zip(batch.data_sources, batch.responses, batch.labels, batch.extra_infos)):
                current[0] = i
                try:
                    results.append(_score(self._fn, *sample))
                except Exception as exc:
                    raise self._failed(i, batch, exc) from exc
        return results

    def _in_pool(self, batch: RewardBatch) -> list[Any]:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_worker_init,
                initargs=(self.path, self.name),
            )
            # multiprocessing's exit handler joins the workers, which leave only once the pool is shut down; the
            # pool's own exit hook runs at interpreter shutdown, which rlrun.launch.failures.leave skips after
            # DeepSpeed was imported (a finished run then waited on its idle workers for ever, now and then)
            atexit.register(self.close)
            # Start every worker (and import the scorer there) before the bound's clock starts: a bound on scoring,
            # not on process start-up. A worker that fails to start breaks the pool: one error, here.
            for ready in [self._pool.submit(_worker_ready) for _ in range(self.workers)]:
                ready.result()
        futures = [
            self._pool.submit(_worker_score, *sample)
            for sample in zip(batch.data_sources, batch.responses, batch.labels, batch.extra_infos)
        ]
        results = []
        end = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        for i, future in enumerate(futures):
            try:
                results.append(future.result(timeout=None if end is None else max(0.0, end - time.monotonic())))
            except FutureTimeout:
                raise self._stuck(i, batch) from None
            except Exception as exc:
                raise self._failed(i, batch, exc) from exc
        return results

    def close(self) -> None:
        """Stop the workers (idle once a run has finished: every future was collected or cancelled)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def _as_rewards(results: list[Any], source: str) -> dict[str, Any]:
    """verl's results (numbers, or dicts with "score") as rlrun's {"rewards", "extra_logs"}."""
    rewards: list[float] = []
    extras: dict[str, list[float]] = {}
    for i, result in enumerate(results):
        if isinstance(result, dict):
            if "score" not in result:
                raise RewardError(
                    f"compute_score {source} returned a dict without 'score' for sample {i} (keys "
                    f"{sorted(map(str, result))}); return a number or a dict with 'score'"
                )
            value = result["score"]
            for key, extra in result.items():
                if key != "score" and isinstance(extra, numbers.Real):
                    extras.setdefault(str(key), []).append(float(extra))
        else:
            value = result
        if not isinstance(value, numbers.Real):  # a bool counts, as float(True) in verl
            raise RewardError(
                f"compute_score {source} returned {str(value)[:80]!r} ({type(value).__name__}) for "
                f"sample {i}; return a number or a dict with a numeric 'score'"
            )
        rewards.append(float(value))
    return {"rewards": rewards, "extra_logs": extras}


def load_compute_score_function(
    path: str, name: str = "compute_score", *, workers: int = 1, call_timeout_s: float | None = None
) -> RewardFunction:
    """verl's compute_score (a file's function, or `builtin`) as a validated RewardFunction; the bound applies per
    sample inside, so the message names the sample."""
    scorer = ComputeScore(path, name, workers, call_timeout_s)
    return RewardFunction(scorer.source, scorer, wrap_errors=False)
