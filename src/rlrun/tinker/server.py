"""The Tinker API on rank 0 (its HTTP transport: rlrun.tinker.http_api): each request validated with the SDK's own
types, answered at once with a future, and its work queued as typed calls (rlrun.tinker.calls) for the request loop
(rlrun.tinker.job), which runs them on every rank and resolves the futures.

What the SDK needs of a server (checked against tinker 0.38's client): `X-API-Key` on every call; a model named
`<session>:train:<n>` (the SDK computes the id itself when it loads from a checkpoint); training requests of a model
run in `seq_id` order (chunks of one forward_backward arrive out of order) and a resent `seq_id` is the same request;
`retrieve_future` is long-polled (the client polls again at once) and answers 408 while pending; forward_backward and
sample results are protobuf. A request rlrun refuses is answered 400 with one line (the SDK's BadRequestError) and
never reaches the ranks; its `seq_id` is spent so that the model's later requests still run.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import tinker.types as tt

from rlrun.data.batching import derive_seed
from rlrun.tinker.calls import (
    Call,
    Forward,
    LoadState,
    OptimStep,
    ResetAdapters,
    Sample,
    SampleParams,
    SaveState,
    Score,
    SyncSampler,
)
from rlrun.tinker.policy import Adam, Scored
from rlrun.tinker.wire import (
    BadRequest,
    Sampled,
    checked_forward_backward,
    forward_backward_output,
    parse,
    sample_response,
    unpack_forward_backward,
)

PROTOBUF = "application/x-protobuf"
# A retrieve_future is held this long before "try again" (the SDK's read timeout for it is 45 s)
LONG_POLL_S = 20.0


# ---- futures -----------------------------------------------------------------------------------------------------


@dataclass
class Result:
    """A future's outcome: a body and its content type, or a failure the SDK raises as RequestFailedError."""

    content_type: str = "application/json"
    body: bytes = b""
    error: str | None = None
    category: str = "user"


# A result fetched is kept this long for a client that fetches it again (a retried poll), then dropped: a long session
# must not hold every answer it ever gave.
KEEP_DELIVERED_S = 600.0
# The SDK raises a failed request (not a user error) only once its telemetry report of it was sent, and waits 30 s
# for that when the server is gone (the SDK telemetry module's FLUSH_TIMEOUT): a failing job takes that report, a few
# seconds at most, before it leaves.
FAILURE_REPORT_S = 3.0


class Futures:
    """The request ids handed out and their results; `wait` blocks until one is done (or the bound passes)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._results: dict[str, Result | None] = {}
        self._delivered: dict[str, float] = {}  # request id -> when first fetched (monotonic), oldest first
        self._ids = itertools.count(1)
        self._reported = 0.0  # when a client's telemetry last arrived (monotonic)

    def create(self) -> str:
        with self._cond:
            self._expire()
            rid = f"req-{next(self._ids)}"
            self._results[rid] = None
            return rid

    def resolve(self, rid: str, result: Result) -> None:
        self.resolve_all({rid: result})

    def resolve_all(self, results: dict[str, Result]) -> None:
        """Several at once: the waiting pollers wake once, not once per result (a wave of 64 sample requests would
        wake its 64 pollers 64 times each)."""
        with self._cond:
            self._results.update(results)
            self._cond.notify_all()

    def fail_pending(self, message: str) -> None:
        """Every future not done yet fails with `message` (the job is ending)."""
        with self._cond:
            for rid, result in self._results.items():
                if result is None:
                    self._results[rid] = Result(error=message, category="server")
            self._cond.notify_all()

    def wait(self, rid: str, timeout_s: float) -> Result | None:
        """The result of `rid` once done (then counted as delivered); None while pending after `timeout_s`.
        KeyError: an id never handed out."""
        with self._cond:
            if rid not in self._results:
                raise KeyError(rid)
            self._cond.wait_for(lambda: self._results[rid] is not None, timeout_s)
            result = self._results[rid]
            if result is not None:
                self._delivered.setdefault(rid, time.monotonic())
                if result.error:
                    self._cond.notify_all()  # a drain_failures waits for this
            return result

    def _expire(self) -> None:
        """Drop the results fetched more than KEEP_DELIVERED_S ago (under the lock)."""
        cutoff = time.monotonic() - KEEP_DELIVERED_S
        while self._delivered:
            rid, fetched = next(iter(self._delivered.items()))
            if fetched > cutoff:
                break
            del self._delivered[rid], self._results[rid]

    def reported(self) -> None:
        """A client's telemetry arrived (the SDK's report of a failure it is about to raise)."""
        with self._cond:
            self._reported = time.monotonic()
            self._cond.notify_all()

    def drain_failures(self, timeout_s: float) -> None:
        """Wait until every failed future was fetched by a client, `timeout_s` at most, then for the report the SDK
        sends before it raises the failure (FAILURE_REPORT_S at most)."""
        with self._cond:
            self._cond.wait_for(
                lambda: all(r is None or not r.error or rid in self._delivered for rid, r in self._results.items()),
                timeout_s,
            )
            fetched = [at for rid, at in self._delivered.items() if (r := self._results.get(rid)) and r.error]
            if fetched:
                self._cond.wait_for(lambda: self._reported >= max(fetched), FAILURE_REPORT_S)


# ---- the work queue ------------------------------------------------------------------------------------------------


@dataclass
class Pending:
    """One queued request: the call every rank runs, and how its result becomes the future's (rank 0)."""

    request_id: str
    call: Call
    respond: Callable[[Any], Result]


@dataclass
class Ordered:
    """One model's requests in seq_id order: the next seq_id to run, those that arrived early, and the request id of
    every seq_id seen (a resent one gets the same future)."""

    next_seq: int = 1
    early: dict[int, Pending | None] = field(default_factory=dict)  # None: a refused request (its seq_id is spent)
    seen: dict[int, str] = field(default_factory=dict)


@dataclass
class Model:
    model_id: str
    base_model: str
    order: Ordered = field(default_factory=Ordered)


@dataclass(frozen=True)
class SamplerSession:
    base_model: str
    version: int  # the weights it samples: 0 the base model, n the n-th save_weights_for_sampler
    model_path: str | None = None


@dataclass(frozen=True)
class Served:
    """What this job serves, for validation and get_info: the model's name, its tokenizer, its LoRA rank (0: full
    fine-tuning), its architecture, the longest datum, where checkpoints go, and the max_tokens cap."""

    model_name: str
    tokenizer_id: str
    lora_rank: int
    arch: str
    max_len: int
    ckpt_root: str
    max_tokens_cap: int


class Front:
    """Rank 0's API state: sessions, the one model, sampler sessions, futures and the work queue."""

    def __init__(self, served: Served, api_key: str | None) -> None:
        self.served = served
        self.api_key = api_key.encode() if api_key else None
        self.futures = Futures()
        self.work: queue.Queue[Pending] = queue.Queue()
        self._lock = threading.RLock()
        self.model: Model | None = None
        self.replaced: set[str] = set()  # model ids a later load replaced
        self.samplers: dict[str, SamplerSession] = {}
        self.sampler_version = 0  # the newest weights sent to the engines (0: the base model)
        self.trained_since_sync = False  # the trained model moved on from the engines' newest weights
        self.sampler_paths: dict[str, int] = {}  # tinker:// path of a named sampler save -> its version
        self._sampler_ids = itertools.count()
        self._saves = itertools.count(1)
        self._draws = itertools.count()
        self.closed: str | None = None  # why the job stopped taking requests
        self.routes = self._routes()  # the JSON routes, built once

    # -- helpers ---------------------------------------------------------------------------------------------------
    def _future(self, call: Call, respond: Callable[[Any], Result]) -> str:
        rid = self.futures.create()
        self.work.put(Pending(rid, call, respond))
        return rid

    def _done(self, payload: dict[str, Any]) -> str:
        """A future already resolved (requests that need no rank)."""
        rid = self.futures.create()
        self.futures.resolve(rid, Result(body=json.dumps(payload).encode()))
        return rid

    def _model(self, model_id: str) -> Model:
        if self.model is not None and model_id == self.model.model_id:
            return self.model
        if model_id in self.replaced:
            raise BadRequest(
                f"model {model_id} was replaced by a later create_model or load_weights; use the training client "
                "it made"
            )
        raise BadRequest(f"unknown model_id {model_id!r}; create_model first (this job serves one model)")

    def _ordered(self, model_id: str, seq_id: int | None, make: Callable[[], Pending]) -> str:
        """Queue `make()`'s request in the model's seq_id order; a resent seq_id gets its first request id. A
        BadRequest from `make` spends the seq_id and reaches the client."""
        with self._lock:
            model = self._model(model_id)
            order = model.order
            if seq_id is None:
                pending = make()
                self.work.put(pending)
                return pending.request_id
            if seq_id in order.seen:
                return order.seen[seq_id]
            if seq_id < order.next_seq:
                raise BadRequest(f"seq_id {seq_id} of {model_id} already ran (the next is {order.next_seq})")
            try:
                pending: Pending | None = make()  # type: ignore[no-redef]
            except BadRequest:
                order.early[seq_id] = None
                order.seen[seq_id] = ""
                self._release(order)
                raise
            assert pending is not None
            order.seen[seq_id] = pending.request_id
            order.early[seq_id] = pending
            self._release(order)
            return pending.request_id

    def _release(self, order: Ordered) -> None:
        while order.next_seq in order.early:
            pending = order.early.pop(order.next_seq)
            if pending is not None:
                self.work.put(pending)
            order.next_seq += 1

    def _pending(self, call: Call, respond: Callable[[Any], Result]) -> Pending:
        return Pending(self.futures.create(), call, respond)

    # -- routes ----------------------------------------------------------------------------------------------------
    def post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """A JSON route's answer (BadRequest: 400; KeyError: 404)."""
        handler = self.routes.get(route)
        if handler is None:
            raise KeyError(route)
        return handler(body)

    def _routes(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        return {
            "client/config": lambda b: {"pjwt_auth_enabled": False},
            "client/dynamic_config": lambda b: {},
            "create_session": self.create_session,
            "session_heartbeat": lambda b: {"type": "session_heartbeat"},
            "telemetry": lambda b: {"status": "accepted"},  # its arrival: rlrun.tinker.http_api says so once answered
            "create_model": self.create_model,
            "get_info": self.get_info,
            "optim_step": self.optim_step,
            "save_weights": self.save_weights,
            "save_weights_for_sampler": self.save_weights_for_sampler,
            "load_weights": self.load_weights,
            "create_sampling_session": self.create_sampling_session,
            "asample": self.asample,
        }

    def create_session(self, body: dict[str, Any]) -> dict[str, Any]:
        parse(tt.CreateSessionRequest, body)
        return {"type": "create_session", "session_id": f"sess-{uuid.uuid4().hex[:12]}"}

    def create_model(self, body: dict[str, Any]) -> dict[str, Any]:
        req = parse(tt.CreateModelRequest, body)
        self._check_base(req.base_model)
        rank = req.lora_config.rank if req.lora_config is not None else 0
        if rank != self.served.lora_rank:
            raise BadRequest(
                f"LoRA rank {rank} asked, this job trains "
                + (f"LoRA rank {self.served.lora_rank}" if self.served.lora_rank else "the full model (rank 0)")
                + f"; start rlrun.tinker with --lora_rank {rank}"
            )
        if req.optimizer_config is not None and req.optimizer_config.type != "adamw":
            raise BadRequest(f"optimizer {req.optimizer_config.type} is not supported; rlrun.tinker runs AdamW")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        answer = {"model_id": model_id, "type": "create_model"}
        with self._lock:
            if self.model is None:
                self.model = Model(model_id, req.base_model)
                return {"request_id": self._done(answer), "model_id": model_id}
            if not self.served.lora_rank:
                raise BadRequest(
                    f"this job already trains model {self.model.model_id} (full fine-tuning: one model per job, the "
                    "base weights are not kept); continue with it, load a checkpoint with "
                    "create_training_client_from_state, or restart the job for a fresh model"
                )
            # a LoRA job starts a fresh model by putting its adapters back: the one before is replaced
            self.replaced.add(self.model.model_id)
            self.model = Model(model_id, req.base_model)
            self.trained_since_sync = True
            return {"request_id": self._future(ResetAdapters(), lambda _: _json(answer)), "model_id": model_id}

    def _check_base(self, base_model: str | None) -> None:
        if base_model is not None and base_model != self.served.model_name:
            raise BadRequest(
                f"base_model {base_model!r} is not served here; this job serves {self.served.model_name!r} "
                "(--tinker_model_name, else --pretrain)"
            )

    def get_info(self, body: dict[str, Any]) -> dict[str, Any]:
        req = parse(tt.GetInfoRequest, body)
        model = self._model(req.model_id)
        s = self.served
        return tt.GetInfoResponse(
            type="get_info",
            model_id=model.model_id,
            model_data=tt.ModelData(arch=s.arch, model_name=s.model_name, tokenizer_id=s.tokenizer_id),
            is_lora=s.lora_rank > 0,
            lora_rank=s.lora_rank or None,
            model_name=s.model_name,
        ).model_dump(mode="json", exclude_none=True)

    def forward_backward(self, body: bytes, encoding: str | None) -> dict[str, Any]:
        msg = unpack_forward_backward(body, encoding)

        def make() -> Pending:
            request = checked_forward_backward(msg, self.served.max_len)
            call = Forward(request.data, request.loss_fn, request.config, request.backward)
            return self._pending(call, lambda passed: _proto(forward_backward_output(passed)))

        rid = self._ordered(msg.model_id, msg.seq_id, make)
        return {"request_id": rid, "model_id": msg.model_id}

    def optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        req = parse(tt.OptimStepRequest, body)

        def make() -> Pending:
            p = req.optim_params
            if not isinstance(p, tt.AdamParams):
                raise BadRequest(f"optimizer {getattr(p, 'type', type(p).__name__)} is not supported; send AdamParams")
            adam = Adam(p.learning_rate, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_clip_norm)
            if not adam.learning_rate >= 0:
                raise BadRequest(f"learning_rate must be >= 0, got {adam.learning_rate}")
            self.trained_since_sync = True
            return self._pending(OptimStep(adam), lambda metrics: _json({"type": "optim_step", "metrics": metrics}))

        return {"request_id": self._ordered(req.model_id, req.seq_id, make), "model_id": req.model_id}

    def save_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        req = parse(tt.SaveWeightsRequest, body)

        def make() -> Pending:
            name = _checked_name(req.path or f"ckpt-{next(self._saves):04d}")
            directory = os.path.join(self.served.ckpt_root, _safe(req.model_id), name)
            if os.path.exists(directory) and not req.overwrite:
                raise BadRequest(f"checkpoint {name!r} exists ({directory}); save with overwrite=True or a new name")
            path = f"tinker://{req.model_id}/weights/{name}"
            return self._pending(SaveState(directory), lambda _: _json({"path": path, "type": "save_weights"}))

        return {"request_id": self._ordered(req.model_id, req.seq_id, make), "model_id": req.model_id}

    def save_weights_for_sampler(self, body: dict[str, Any]) -> dict[str, Any]:
        req = parse(tt.SaveWeightsForSamplerRequest, body)

        def make() -> Pending:
            with self._lock:
                self.sampler_version += 1
                self.trained_since_sync = False
                version = self.sampler_version
                if req.path is not None:
                    path = f"tinker://{req.model_id}/sampler_weights/{_checked_name(req.path)}"
                    self.sampler_paths[path] = version
                    answer: dict[str, Any] = {"path": path, "type": "save_weights_for_sampler"}
                else:
                    sid = self._new_sampler(req.model_id.split(":train:")[0], SamplerSession(self._base(), version))
                    answer = {"sampling_session_id": sid, "type": "save_weights_for_sampler"}
            return self._pending(SyncSampler(), lambda _: _json(answer))

        return {"request_id": self._ordered(req.model_id, req.seq_id, make), "model_id": req.model_id}

    def _base(self) -> str:
        return self.model.base_model if self.model is not None else self.served.model_name

    def _new_sampler(self, session_id: str, session: SamplerSession) -> str:
        sid = f"{session_id}:sample:{next(self._sampler_ids)}"
        self.samplers[sid] = session
        return sid

    def load_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        req = parse(tt.LoadWeightsRequest, body)
        directory = self._checkpoint_dir(req.path)
        if req.model_id is not None:  # the deprecated load into an existing model
            model_id = req.model_id
        elif req.session_id is not None and req.model_seq_id is not None:
            self._check_base(req.base_model)
            model_id = f"{req.session_id}:train:{req.model_seq_id}"
        else:
            raise BadRequest("load_weights needs model_id, or session_id and model_seq_id")
        answer = {"path": req.path, "model_id": model_id, "type": "load_weights"}
        call = LoadState(directory, bool(req.optimizer))
        self.trained_since_sync = True
        if req.model_id is not None:
            make = lambda: self._pending(call, lambda _: _json(answer))  # noqa: E731 - the ordered queue's maker
            return {"request_id": self._ordered(model_id, req.seq_id, make), "model_id": model_id}
        with self._lock:  # the load makes the model: it replaces the one before (one model per job)
            if self.model is not None:
                self.replaced.add(self.model.model_id)
            self.model = Model(model_id, req.base_model or self.served.model_name)
            return {"request_id": self._future(call, lambda _: _json(answer)), "model_id": model_id}

    def _checkpoint_dir(self, path: str) -> str:
        """The directory a tinker://<model>/weights/<name> path of this job names (it must hold a checkpoint)."""
        try:
            parsed = tt.ParsedCheckpointTinkerPath.from_tinker_path(path)
        except ValueError as exc:
            raise BadRequest(f"path {path!r}: {exc}") from None
        if parsed.checkpoint_type != "training":
            raise BadRequest(f"path {path!r} is not a training checkpoint (tinker://MODEL/weights/NAME)")
        name = _checked_name(parsed.checkpoint_id.split("/", 1)[1])
        directory = os.path.join(self.served.ckpt_root, _safe(parsed.training_run_id), name)
        if not os.path.isdir(directory):
            raise BadRequest(f"no checkpoint at {path} ({directory} does not exist; save_state writes it)")
        return directory

    def create_sampling_session(self, body: dict[str, Any]) -> dict[str, Any]:
        req = parse(tt.CreateSamplingSessionRequest, body)
        with self._lock:
            if req.model_path is not None:
                version = self.sampler_paths.get(req.model_path)
                if version is None:
                    raise BadRequest(
                        f"model_path {req.model_path} names no sampler weights of this job (rlrun.tinker samples "
                        "the weights save_weights_for_sampler sent to its engines)"
                    )
                session = SamplerSession(self._base(), version, req.model_path)
            else:
                self._check_base(req.base_model)
                session = SamplerSession(req.base_model or self.served.model_name, 0)
            sid = self._new_sampler(req.session_id, session)
        return {"type": "create_sampling_session", "sampling_session_id": sid}

    def sampler(self, sampler_id: str) -> dict[str, Any]:
        session = self.samplers.get(sampler_id)
        if session is None:
            raise KeyError(sampler_id)
        out = {"sampler_id": sampler_id, "base_model": session.base_model}
        return out | ({"model_path": session.model_path} if session.model_path else {})

    def asample(self, body: dict[str, Any]) -> dict[str, Any]:
        req = parse(tt.SampleRequest, body)
        session = self._sampling_session(req)
        if req.prompt_logprobs:
            return self._compute_logprobs(req, session)
        params = self._sample_params(req)
        prompt = _tokens(req.prompt)
        if not prompt:
            raise BadRequest("the prompt is empty")
        if len(prompt) + params.max_tokens > self.served.max_len:
            raise BadRequest(
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceed --max_len "
                f"{self.served.max_len}"
            )
        with self._lock:
            if session.version != self.sampler_version:
                raise BadRequest(
                    f"this sampling client samples weights version {session.version}, the engines hold version "
                    f"{self.sampler_version}: rlrun.tinker serves the newest sampler weights only; sample with the "
                    "client of the latest save_weights_for_sampler"
                )
            draw = req.sampling_params.seed if req.sampling_params.seed is not None else next(self._draws) + 2**40
            keys = [derive_seed("tinker", draw, j) & 0xFFFFFFFF for j in range(req.num_samples)]
            ids = [f"seq-{uuid.uuid4().hex[:12]}" for _ in range(req.num_samples)]
            call = Sample([prompt] * req.num_samples, keys, params)
            rid = self._future(call, lambda sampled: _proto(sample_response(sampled)))
        return {"request_id": rid, "sample_sequence_ids": ids}

    def _compute_logprobs(self, req: tt.SampleRequest, session: SamplerSession) -> dict[str, Any]:
        """A sample request with prompt_logprobs (the SDK's compute_logprobs: one sample of one token) runs on the
        trained model: when it holds the session's weights (the newest sampler weights and no step since), or with
        its LoRA adapters off for a base-model session."""
        p = req.sampling_params
        prompt = _tokens(req.prompt)
        if p.max_tokens != 1 or req.num_samples != 1:
            raise BadRequest(
                "prompt_logprobs is supported for compute_logprobs's requests (num_samples 1, max_tokens 1) only, got "
                f"num_samples {req.num_samples}, max_tokens {p.max_tokens}"
            )
        self._refuse_unsupported(req, ("prompt_logprobs",))
        if not p.temperature > 0:
            raise BadRequest(f"temperature must be > 0 (rlrun's engines sample), got {p.temperature}")
        if not 2 <= len(prompt) <= self.served.max_len:
            raise BadRequest(f"prompt_logprobs needs a prompt of 2..{self.served.max_len} tokens, got {len(prompt)}")
        with self._lock:
            current = session.version == self.sampler_version and not self.trained_since_sync
            base = not current and session.version == 0 and self.served.lora_rank > 0
            if not current and not base:
                raise BadRequest(
                    f"compute_logprobs on weights version {session.version}: the trained model no longer holds them "
                    "(rlrun.tinker scores with the trained model: the newest sampler weights before the next step, "
                    "or a LoRA job's base model)"
                )
            draw = p.seed if p.seed is not None else next(self._draws) + 2**40
            call = Score([prompt], [derive_seed("tinker", draw, 0) & 0xFFFFFFFF], float(p.temperature), base)

            def respond(scored: Scored) -> Result:
                token, log_prob = scored.drawn[0]
                return _proto(sample_response([Sampled([token], [log_prob], False)], scored.prompt_log_probs[0]))

            rid = self._future(call, respond)
        return {"request_id": rid, "sample_sequence_ids": [f"seq-{uuid.uuid4().hex[:12]}"]}

    def _refuse_unsupported(self, req: tt.SampleRequest, allowed: tuple[str, ...] = ()) -> None:
        p = req.sampling_params
        unsupported = [
            name
            for name, asked in (
                ("prompt_logprobs", bool(req.prompt_logprobs)),
                ("topk_prompt_logprobs", req.topk_prompt_logprobs > 0),
                ("topk_sample_logprobs", req.topk_sample_logprobs > 0),
                ("target_prompt_logprobs", req.target_prompt_logprobs is not None),
                ("prompt_alt_tokens_k", req.prompt_alt_tokens_k > 0),
                ("record_stability_info", bool(req.record_stability_info)),
                ("top_k", p.top_k not in (-1, 0)),
            )
            if asked and name not in allowed
        ]
        if unsupported:
            why = (
                ": it records what the stable_reinforce loss trains on, which rlrun.tinker does not compute (a "
                "cookbook recipe samples so when its loss_fn is stable_reinforce: set loss_fn=importance_sampling, "
                "ppo or cispo)"
                if "record_stability_info" in unsupported
                else ""
            )
            raise BadRequest(f"rlrun.tinker does not support {', '.join(unsupported)} in sample requests (v1){why}")

    def _sampling_session(self, req: tt.SampleRequest) -> SamplerSession:
        if req.sampling_session_id is not None:
            session = self.samplers.get(req.sampling_session_id)
            if session is None:
                raise BadRequest(f"unknown sampling_session_id {req.sampling_session_id!r}")
            return session
        if req.model_path is not None:
            version = self.sampler_paths.get(req.model_path)
            if version is None:
                raise BadRequest(f"model_path {req.model_path} names no sampler weights of this job")
            return SamplerSession(self._base(), version, req.model_path)
        self._check_base(req.base_model)
        return SamplerSession(self.served.model_name, 0)

    def _sample_params(self, req: tt.SampleRequest) -> SampleParams:
        p = req.sampling_params
        self._refuse_unsupported(req)
        if not 1 <= req.num_samples <= 4096:
            raise BadRequest(f"num_samples must be in 1..4096, got {req.num_samples}")
        if not p.temperature > 0:
            raise BadRequest(f"temperature must be > 0 (rlrun's engines sample), got {p.temperature}")
        if not 0 < p.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {p.top_p}")
        cap = self.served.max_tokens_cap
        max_tokens = cap if p.max_tokens is None else p.max_tokens
        if not 1 <= max_tokens <= cap:
            raise BadRequest(f"max_tokens must be in 1..{cap} (--max_tokens_cap), got {max_tokens}")
        stop = p.stop
        stop_tokens: tuple[int, ...] | None
        stop_strings: tuple[str, ...]
        if stop is None:
            stop_tokens, stop_strings = None, ()
        elif isinstance(stop, str):
            stop_tokens, stop_strings = None, (stop,)
        elif all(isinstance(s, int) for s in stop):
            stop_tokens, stop_strings = tuple(int(s) for s in stop), ()
        else:
            stop_tokens, stop_strings = None, tuple(str(s) for s in stop)
        return SampleParams(max_tokens, float(p.temperature), float(p.top_p), stop_tokens, stop_strings)

    def capabilities(self) -> dict[str, Any]:
        s = self.served
        return {
            "supported_models": [
                {"model_name": s.model_name, "max_context_length": s.max_len, "trainable": True, "sampleable": True}
            ]
        }

    def close(self, reason: str) -> None:
        """The job stops: every pending future fails with `reason`, and later requests get a 410 saying it."""
        self.closed = reason
        self.futures.fail_pending(reason)


def _json(payload: dict[str, Any]) -> Result:
    return Result(body=json.dumps(payload, allow_nan=False).encode())


def _proto(body: bytes) -> Result:
    return Result(content_type=PROTOBUF, body=body)


def _tokens(model_input: tt.ModelInput) -> list[int]:
    try:
        return [int(t) for t in model_input.to_ints()]
    except ValueError:
        raise BadRequest("the prompt holds non-text chunks; rlrun.tinker samples text policies only") from None


def _checked_name(name: str) -> str:
    """A checkpoint name usable as one directory name."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or len(name) > 200:
        raise BadRequest(f"checkpoint name {name!r} must be one path component (no '/'), at most 200 characters")
    return name


def _safe(model_id: str) -> str:
    """A model id as a directory name (its ':' are kept out of paths)."""
    return model_id.replace(":", "_")
