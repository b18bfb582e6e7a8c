"""The request-driven loop of rlrun.tinker, beside the step-driven one of the other trainers (rlrun.run.skeleton runs
either: start-up, failure reporting and teardown are written once there).

Rank 0 takes the next queued request (rlrun.tinker.server), or after --tinker_keepalive seconds without one a
keepalive, and broadcasts it to every rank as JSON; every rank runs it (`Worker`); rank 0 resolves its future.
Sample requests with equal settings that wait together run as one engine call. A preemption notice (SIGTERM,
SIGUSR1) stops the loop between requests. A failure anywhere fails the pending futures with rlrun's one line before
the rank leaves, so a client sees an error, not a hang.
"""

from __future__ import annotations

import queue
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from rlrun.checkpoint.checkpointer import Checkpointer, Contents, Identity, Part
from rlrun.config.checkpoint import SavingConfig
from rlrun.launch.transfer import broadcast_json
from rlrun.runtime.log import get_logger
from rlrun.runtime.phases import Phase, PhaseTracker
from rlrun.runtime.pyfile import one_line
from rlrun.tinker import calls
from rlrun.tinker.calls import (
    Call,
    Forward,
    Keepalive,
    LoadState,
    OptimStep,
    ResetAdapters,
    Sample,
    SaveState,
    Score,
    Stop,
    SyncSampler,
)
from rlrun.tinker.policy import TrainedPolicy
from rlrun.tinker.sampler import Sampler
from rlrun.tinker.server import Front, Pending, Result
from rlrun.weight_sync.sync import WeightSync


@dataclass
class Snapshots:
    """save_state / load_state through rlrun's checkpointer: each name is a checkpoint root of its own (atomic,
    checksummed, owned by this run), holding the model and optimizer state and the optimizer step."""

    saving: SavingConfig
    identity: Identity
    parts: list[Part]
    trained: list[torch.nn.Module]
    config: dict[str, Any]
    run_id: str
    group: torch.distributed.ProcessGroup
    device: torch.device
    timeout_s: float

    def _at(self, policy: TrainedPolicy, directory: str) -> Checkpointer:
        saving = replace(self.saving, ckpt_path=directory, max_ckpt_num=1, save_steps=1)
        return Checkpointer(
            saving,
            Contents(self.identity, policy, self.parts, self.trained),
            config=self.config,
            run_id=self.run_id,
            world_size=torch.distributed.get_world_size(self.group),
            group=self.group,
            device=self.device,
            timeout_s=self.timeout_s,
        )

    def save(self, policy: TrainedPolicy, directory: str) -> None:
        if torch.distributed.get_rank(self.group) == 0:  # an overwrite (checked on rank 0 before the call)
            shutil.rmtree(directory, ignore_errors=True)
        self._at(policy, directory).save(policy.steps)

    def load(self, policy: TrainedPolicy, directory: str, optimizer: bool) -> None:
        self._at(policy, directory).restore()
        if not optimizer:  # the weights only: Adam starts again
            policy.optimizer.state.clear()


@dataclass
class Worker:
    """What every rank runs for a call; the result on rank 0."""

    policy: TrainedPolicy
    sampler: Sampler
    weights: WeightSync
    snapshots: Snapshots
    phase: PhaseTracker

    def run(self, call: Call) -> Any:
        step = self.policy.steps
        if isinstance(call, Forward):
            with self.phase(Phase.TRAIN if call.backward else Phase.SCORE, step):
                return self.policy.forward(call.data, call.loss_fn, call.config, backward=call.backward)
        if isinstance(call, OptimStep):
            with self.phase(Phase.TRAIN, step):
                return self.policy.optim_step(call.adam)
        if isinstance(call, SyncSampler):
            with self.phase(Phase.SYNC, step):
                self.weights.sync()
                self.sampler.engine.load_weights()
            return None
        if isinstance(call, Sample):
            with self.phase(Phase.GENERATE, step):
                return self.sampler.sample(call)
        if isinstance(call, Score):
            with self.phase(Phase.SCORE, step):
                return self.policy.score(call.prompts, call.keys, call.temperature, call.base)
        if isinstance(call, ResetAdapters):
            self.policy.reset_adapters()
            return None
        if isinstance(call, SaveState):
            with self.phase(Phase.SAVE, step):
                self.snapshots.save(self.policy, call.directory)
            return None
        if isinstance(call, LoadState):
            with self.phase(Phase.LOAD, step):
                self.snapshots.load(self.policy, call.directory, call.optimizer)
            return None
        raise AssertionError(f"no call {call!r}")


# Sample requests with equal settings run as one call while they keep coming, for at most WAVE_S: a wave is over when
# none came for WAVE_GAP_S after its first request, or later for WAVE_GAPS times its longest gap so far, within
# [WAVE_GAP_MIN_S, WAVE_GAP_S]. (A fixed 20 ms was 4-5 % of the SDK bench's wave of 64 requests, whose gaps are 1-4 ms
# on 2 shared cores.)
WAVE_GAP_MIN_S, WAVE_GAP_S, WAVE_GAPS, WAVE_S = 0.005, 0.02, 4, 0.25
# How often rank 0, waiting for a request, checks for a stop notice.
STOP_POLL_S = 0.2
# How long rank 0 keeps answering after a failure, for the clients to fetch their failed futures.
FAILURE_GRACE_S = 10.0


class Serving:
    """rlrun.tinker's job for the run skeleton: no steps; `serve` runs requests until stopped (rank 0 holds the API
    front, the other ranks None)."""

    total_steps = 0

    def __init__(
        self,
        worker: Worker,
        front: Front | None,
        group: torch.distributed.ProcessGroup,
        comm_device: torch.device,
        keepalive_s: float,
    ) -> None:
        self.worker, self.front, self.group, self.comm_device = worker, front, group, comm_device
        self.keepalive_s = keepalive_s
        self.step = 0
        self.requests = 0
        self._held: Pending | None = None  # taken while gathering sample requests, runs next

    # the skeleton's Job surface (the state is the policy's, saved with each snapshot)
    def begin(self) -> None: ...

    def train_step(self, step: int) -> dict[str, float]:
        raise AssertionError("rlrun.tinker runs requests, not steps")

    def evaluate(self, steps_done: int) -> dict[str, float] | None:
        return None

    def finish(self) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return self.worker.policy.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.worker.policy.load_state_dict(state)

    def serve(self, stopping: Callable[[], bool]) -> None:
        """Run requests until rank 0 hears a stop (`stopping()`: a preemption notice). Collective."""
        try:
            while True:
                pendings = self._next(stopping) if self.front is not None else []
                call = _merged(pendings) if pendings else self._idle(stopping)
                message = broadcast_json(calls.encode(call) if self.front else None, 0, self.group, self.comm_device)
                call = calls.decode(message)  # type: ignore[arg-type]  # rank 0's encode: a dict
                if isinstance(call, Stop):
                    break
                if isinstance(call, Keepalive):
                    continue
                result = self.worker.run(call)
                if self.front is not None:
                    self.requests += len(pendings)
                    _resolve(self.front, pendings, result)
        except BaseException as exc:
            self._fail_clients(f"rlrun.tinker stopped: {one_line(exc)}")
            raise
        if self.front is not None:
            self.front.close("rlrun.tinker is shutting down (a stop signal)")
            get_logger(0).info_once(f"rlrun.tinker: stopped after {self.requests} requests")

    def last_words(self) -> None:
        """Rank 0, when torchrun stops it because another rank ended (before this rank's collective failed, or while
        it waited outside Python): the pending requests fail with that."""
        self._fail_clients(
            "rlrun.tinker stopped: another rank of the job ended and torchrun stopped the rest (that rank's log has "
            "its failure)"
        )

    def _fail_clients(self, reason: str) -> None:
        """Rank 0: every pending request fails with `reason`, and the clients fetch their failed futures before the
        process leaves (a client whose poll finds the port closed would retry for minutes): until each is fetched,
        FAILURE_GRACE_S at most."""
        if self.front is not None:
            self.front.close(reason)
            self.front.futures.drain_failures(FAILURE_GRACE_S)

    def _idle(self, stopping: Callable[[], bool]) -> Call:
        return Stop() if self.front is not None and stopping() else Keepalive()

    def _next(self, stopping: Callable[[], bool]) -> list[Pending]:
        """The next request, and the sample requests with the same settings queued right behind it."""
        assert self.front is not None
        if self._held is not None:
            first, self._held = self._held, None
        else:
            # a stop notice is heard within STOP_POLL_S, not after a keepalive period (Slurm's grace before its
            # SIGKILL can be shorter than --tinker_keepalive)
            deadline = time.monotonic() + self.keepalive_s
            while True:
                try:
                    first = self.front.work.get(timeout=max(0.0, min(STOP_POLL_S, deadline - time.monotonic())))
                    break
                except queue.Empty:
                    if stopping() or time.monotonic() >= deadline:
                        return []
        if stopping():
            self.front.work.put(first)  # failed by close() with the others
            return []
        taken = [first]
        # A wave of sample requests (a cookbook loop sends one per prompt group at once) arrives over some
        # milliseconds: wait while they keep coming, so that they share one engine call rather than the first
        # decoding alone
        last = time.monotonic()
        deadline, gap, longest = last + WAVE_S, WAVE_GAP_S, 0.0
        while isinstance(first.call, Sample):
            try:
                more = self.front.work.get(timeout=max(0.0, min(gap, deadline - time.monotonic())))
            except queue.Empty:
                break
            now = time.monotonic()
            longest, last = max(longest, now - last), now
            gap = min(WAVE_GAP_S, max(WAVE_GAP_MIN_S, WAVE_GAPS * longest))
            if isinstance(more.call, Sample) and more.call.params == first.call.params:
                taken.append(more)
            else:
                self._held = more
                break
        return taken


def _merged(pendings: list[Pending]) -> Call:
    """One call for the pending requests: a lone request's own, or one Sample over several requests' rows."""
    if len(pendings) == 1:
        return pendings[0].call
    samples = [p.call for p in pendings if isinstance(p.call, Sample)]
    assert len(samples) == len(pendings), "only sample requests are merged"
    prompts = [row for s in samples for row in s.prompts]
    keys = [k for s in samples for k in s.keys]
    return Sample(prompts, keys, samples[0].params)


def _resolve(front: Front, pendings: list[Pending], result: Any) -> None:
    """Rank 0: each request's future from the call's result (a merged sample's rows split back per request)."""
    start, outcomes = 0, {}
    for pending in pendings:
        part = result
        if len(pendings) > 1:
            rows = len(pending.call.prompts)  # type: ignore[union-attr]
            part, start = result[start : start + rows], start + rows
        try:
            outcome = pending.respond(part)
        except Exception as exc:  # noqa: BLE001 - one request's answer failing must not end the job
            outcome = Result(error=f"rlrun.tinker could not encode the result: {one_line(exc)}", category="server")
        outcomes[pending.request_id] = outcome
    front.futures.resolve_all(outcomes)
