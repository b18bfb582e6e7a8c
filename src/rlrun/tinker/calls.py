"""What rank 0 hands every rank for one Tinker request: a typed call, sent as JSON (never pickle) by
rlrun.launch.transfer.broadcast_json, executed by every rank in the same order (rlrun.tinker.job)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from rlrun.tinker.policy import Adam, Datum


@dataclass(frozen=True)
class Keepalive:
    """Nothing to do: sent while no request runs, so that the other ranks' wait stays under --dist_timeout."""

    kind: ClassVar[str] = "keepalive"


@dataclass(frozen=True)
class Stop:
    """The server is stopping (a preemption notice or SIGTERM): every rank leaves the request loop."""

    kind: ClassVar[str] = "stop"


@dataclass(frozen=True)
class Forward:
    kind: ClassVar[str] = "forward"
    data: list[Datum]
    loss_fn: str
    config: dict[str, float]
    backward: bool


@dataclass(frozen=True)
class OptimStep:
    kind: ClassVar[str] = "optim_step"
    adam: Adam


@dataclass(frozen=True)
class SyncSampler:
    """save_weights_for_sampler: the newest weights into every rank's engine."""

    kind: ClassVar[str] = "sync_sampler"


@dataclass(frozen=True)
class SaveState:
    kind: ClassVar[str] = "save_state"
    directory: str


@dataclass(frozen=True)
class LoadState:
    kind: ClassVar[str] = "load_state"
    directory: str
    optimizer: bool  # False: the weights only, the optimizer restarts


@dataclass(frozen=True)
class SampleParams:
    """One sample request's settings (requests with equal settings are sampled in one engine call)."""

    max_tokens: int
    temperature: float
    top_p: float
    stop_tokens: tuple[int, ...] | None  # None: the model's end-of-sequence ids
    stop_strings: tuple[str, ...]


@dataclass(frozen=True)
class Sample:
    """Rows to sample (prompt tokens, draw key), all with the same settings; the rows of several requests."""

    kind: ClassVar[str] = "sample"
    prompts: list[list[int]]
    keys: list[int]
    params: SampleParams


@dataclass(frozen=True)
class Score:
    """compute_logprobs (a sample of one token with prompt_logprobs) on the trained model: `base` with its LoRA
    adapters off."""

    kind: ClassVar[str] = "score"
    prompts: list[list[int]]
    keys: list[int]
    temperature: float
    base: bool


@dataclass(frozen=True)
class ResetAdapters:
    """create_model again on a LoRA job: the adapters and Adam start over."""

    kind: ClassVar[str] = "reset_adapters"


Call = Keepalive | Stop | Forward | OptimStep | SyncSampler | SaveState | LoadState | Sample | Score | ResetAdapters
_KINDS: dict[str, type] = {
    c.kind: c
    for c in (Keepalive, Stop, Forward, OptimStep, SyncSampler, SaveState, LoadState, Sample, Score, ResetAdapters)
}


def encode(call: Call) -> dict[str, Any]:
    return {"kind": call.kind, **dataclasses.asdict(call)}


def decode(message: dict[str, Any]) -> Call:
    """The call `encode` wrote (rank 0's own message: trusted)."""
    body = {k: v for k, v in message.items() if k != "kind"}
    kind = _KINDS[message["kind"]]
    if kind is Forward:
        body["data"] = [Datum(d["tokens"], d["inputs"]) for d in body["data"]]
    elif kind is OptimStep:
        body["adam"] = Adam(**body["adam"])
    elif kind is Sample:
        p = body["params"]
        stops = p["stop_tokens"]
        body["params"] = SampleParams(
            p["max_tokens"],
            p["temperature"],
            p["top_p"],
            None if stops is None else tuple(stops),
            tuple(p["stop_strings"]),
        )
    call: Call = kind(**body)
    return call
