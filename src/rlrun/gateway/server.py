"""The token gateway: an HTTP server on an engine rank that lets environments and agent programs written for vLLM's
or OpenAI's API sample from rlrun's engine, and records exactly what the engine sampled for each session.

Threads: the HTTP server answers each request on its own thread, which reads the request (rlrun.gateway.wire) and
queues it; the engine is driven only by the rank's own thread, inside `serve()`, which takes every queued request
at once and samples them as one batch (concurrent requests share engine steps; a request that arrives during a
batch joins the next). Outside `serve()` - during a weight sync, the update, or between steps - requests wait in
the queue, so a request is sampled with one version of the weights, the one its answer names (`weight_version`).
Every wait is bounded: a request not answered within `answer_timeout` gets 503 and is dropped from the queue.

Sessions: an episode's calls go through `/s/<id>/v1/...` (or carry `X-Session-ID: <id>`, as verifiers' client
sends it); the gateway keeps each call's prompt ids, sampled ids and log-probs for that session, which are what the
trainer trains on - never a re-tokenisation of the text the client saw.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import cast

from transformers import PreTrainedTokenizerBase

from rlrun.engines.protocol import Engine, cut_at_stop
from rlrun.gateway.wire import ROUTES, Call, Completion, Limits, WireError, models
from rlrun.runtime.errors import RlrunError
from rlrun.serving.http_service import BadRequest, JsonHandler, JsonHTTPServer


@dataclass
class Recorded:
    """One sampled call of a session."""

    call: Call
    done: Completion


@dataclass
class Session:
    """An episode's calls, in the order they were answered. `base_url`: what an OpenAI client is pointed at;
    `number`: its place among the gateway's sessions, which with the count of its calls keys each call's draws."""

    id: str
    base_url: str
    number: int
    calls: list[Recorded] = field(default_factory=list)
    submitted: int = 0  # calls sent to the engine so far


LINGER_S = 0.02  # a batch waits this long for one more request (HTTP threads read and tokenise each first)...
GATHER_S = 0.25  # ...and no longer than this in all: small beside an engine call's decode

# A call's draw key: session number x CALL_KEYS + its call number (sessionless calls: past every session's keys).
CALL_KEYS = 1 << 12


@dataclass
class _Pending:
    call: Call
    session: Session | None
    key: int  # the engine draws this call's tokens from (the phase's seed, key): the same whatever its batch
    answered: threading.Event = field(default_factory=threading.Event)
    done: Completion | None = None
    error: str | None = None
    abandoned: bool = False  # its client stopped waiting: not sampled


class GatewayError(RlrunError):
    """The gateway cannot start or serve (its port, an engine that reports no log-probs)."""


class Gateway:
    """The gateway of one engine rank: started once, served during each rollout phase, closed at the end."""

    def __init__(
        self,
        limits: Limits,
        tokenizer: PreTrainedTokenizerBase,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        answer_timeout: float = 600.0,
        max_calls: int | None = None,
    ) -> None:
        """max_calls: most calls one session may make (--max_turns); answer_timeout: seconds a request waits for
        the engine before it is answered 503."""
        self.limits, self.tokenizer = limits, tokenizer
        self.end_ids: tuple[int, ...] = ()  # the serving engine's (a response ends at them)
        self.answer_timeout, self.max_calls = answer_timeout, max_calls
        self.token = f"rlrun-{secrets.token_hex(16)}"  # the run's own key: OPENAI_API_KEY of its agent programs
        self._queue: queue.Queue[_Pending] = queue.Queue()
        self._sessions: dict[str, Session] = {}
        self._opened = 0  # sessions opened so far
        self._sessionless = 0  # calls outside any session so far
        self._lock = threading.Lock()
        self.batches = 0  # engine calls made (each a batch of requests)
        self.requests = 0
        try:
            self.server = _GatewayHTTPServer(self, (host, port))
        except OSError as exc:
            raise GatewayError(
                f"the gateway cannot listen on {host}:{port}: {exc}; free the port or pass --gateway_port 0"
            ) from None
        bound = cast("tuple[str, int]", self.server.server_address[:2])
        self.url = f"http://{host}:{bound[1]}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True, name="rlrun-gateway"
        )
        self._thread.start()

    # -- sessions ------------------------------------------------------------------------------------------------
    def open_session(self) -> Session:
        sid = secrets.token_hex(8)
        with self._lock:
            session = Session(sid, f"{self.url}/s/{sid}/v1", self._opened)
            self._opened += 1
            self._sessions[sid] = session
        return session

    def close_session(self, session: Session) -> None:
        with self._lock:
            self._sessions.pop(session.id, None)

    def session(self, sid: str) -> Session | None:
        with self._lock:
            return self._sessions.get(sid)

    def at_end(self, done: Completion) -> bool:
        """The reply ends with one of the serving engine's end ids (so a chat template's end marker after it is
        already there)."""
        return bool(done.tokens) and done.tokens[-1] in self.end_ids

    # -- the HTTP threads' side ----------------------------------------------------------------------------------
    def submit(self, call: Call, session: Session | None) -> Completion:
        """Queue one call and wait (at most answer_timeout) for the engine thread to sample it."""
        if session is not None and self.max_calls is not None and len(session.calls) >= self.max_calls:
            raise WireError(
                HTTPStatus.BAD_REQUEST,
                f"this episode has made its {self.max_calls} model calls (--max_turns); end the episode",
                code="max_turns",
            )
        with self._lock:
            if session is not None:
                key = session.number * CALL_KEYS + session.submitted % CALL_KEYS
                session.submitted += 1
            else:
                key = (self._opened + 1 + self._sessionless) * CALL_KEYS
                self._sessionless += 1
        pending = _Pending(call, session, key)
        self._queue.put(pending)
        if not pending.answered.wait(self.answer_timeout):
            pending.abandoned = True
            raise WireError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"the engine did not sample this request within {self.answer_timeout:g} s (the run samples only "
                "while its rollouts run); send it again",
                code="timeout",
            )
        if pending.error is not None:
            raise WireError(HTTPStatus.INTERNAL_SERVER_ERROR, pending.error)
        assert pending.done is not None
        return pending.done

    # -- the engine thread's side --------------------------------------------------------------------------------
    def serve(self, engine: Engine, seed: int, version: int, until: Callable[[], bool], poll_s: float = 0.005) -> None:
        """Sample queued requests on `engine` (policy version `version`) until `until()` holds. Each call's tokens
        are drawn from (`seed`, its key), so an episode samples the same whichever calls shared its batch (the
        native engine; vLLM with --vllm_seeded_requests). Runs on the rank's own thread: the only one that drives
        the engine."""
        self.end_ids = engine.sampling.end_ids
        while not until():
            try:
                first = self._queue.get(timeout=poll_s)
            except queue.Empty:
                continue
            batch = [first] + self._gather()
            live = [p for p in batch if not p.abandoned]
            if live:
                self._sample(engine, live, seed, version)

    def _gather(self) -> list[_Pending]:
        """The requests that follow the first closely: taken until none comes for LINGER_S, at most GATHER_S, so
        a wave of requests sent at once (a step's episodes) is one engine call, not a first one and the rest."""
        out: list[_Pending] = []
        until = time.monotonic() + GATHER_S
        while (left := until - time.monotonic()) > 0:
            try:
                out.append(self._queue.get(timeout=min(LINGER_S, left)))
            except queue.Empty:
                break
        return out

    def _sample(self, engine: Engine, batch: list[_Pending], seed: int, version: int) -> None:
        """One engine call per distinct set of stop strings (the engine ends a batch's rows at one set)."""
        self.batches += 1
        by_stop: dict[tuple[str, ...], list[_Pending]] = {}
        for p in batch:
            by_stop.setdefault(p.call.stop, []).append(p)
        try:
            for stop, group in by_stop.items():
                cap = max(p.call.max_tokens for p in group)
                generation = engine.sample(
                    [p.call.prompt for p in group], seed, max_new_tokens=cap, stop=stop, keys=[p.key for p in group]
                )
                if generation.log_probs is None:
                    raise GatewayError(
                        "the engine reports no log-probs (--generation_backend hf); the gateway needs native or vllm"
                    )
                for p, tokens, lps in zip(group, generation.responses, generation.log_probs):
                    p.done = self._complete(p.call, tokens, lps, version)
        except Exception as exc:
            for p in batch:
                p.error = f"the engine failed: {type(exc).__name__}: {exc}"
                p.answered.set()
            raise
        self.requests += len(batch)
        for p in batch:
            assert p.done is not None
            if p.session is not None:
                p.session.calls.append(Recorded(p.call, p.done))
            p.answered.set()

    def _complete(self, call: Call, tokens: list[int], log_probs: list[float], version: int) -> Completion:
        """A row of the batch cut to this call's own cap and stop ids (the prefix is exactly what was sampled:
        sampling past a stop changes nothing before it), and why it ended."""
        tokens = tokens[: call.max_tokens]
        for k, t in enumerate(tokens):
            if t in call.stop_token_ids:
                tokens = tokens[: k + 1]
                break
        ends = set(self.end_ids) | set(call.stop_token_ids)
        stopped = bool(tokens) and tokens[-1] in ends
        if not stopped and call.stop:
            stopped = len(cut_at_stop(tokens, call.stop, self.tokenizer)) == len(tokens) and any(
                s in self.tokenizer.decode(tokens, skip_special_tokens=False) for s in call.stop
            )
        finish = "stop" if stopped or len(tokens) < call.max_tokens else "length"
        return Completion(tokens, [float(x) for x in log_probs[: len(tokens)]], finish, version)

    def close(self) -> None:
        """Stop answering; queued requests get 503 when their wait ends."""
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)


class _GatewayHTTPServer(JsonHTTPServer):
    # A step's episodes connect at once; socketserver's default backlog of 5 resets the connections beyond it.
    request_queue_size = 1024

    def __init__(self, gateway: Gateway, address: tuple[str, int]) -> None:
        self.gateway = gateway
        super().__init__(
            address,
            _GatewayHandler,
            log_name="rlrun-gateway",
            token=gateway.token,
            token_env="OPENAI_API_KEY",
            max_request_bytes=16 * 1024 * 1024,
            request_timeout=60.0,
            quiet=True,
        )


class _GatewayHandler(JsonHandler):
    server: _GatewayHTTPServer
    post_paths = tuple(ROUTES)

    def _error(self, status: HTTPStatus, message: str, headers: dict[str, str] | None = None) -> None:
        # OpenAI's error shape: the SDKs and OpenEnv's validate_llm read error.message.
        self._send_json(status, WireError(status, message).body(), headers)

    def _route(self) -> tuple[Session | None, str]:
        """(the session named by the path or X-Session-ID, the route without the session prefix)."""
        path = self.path.split("?", 1)[0]
        in_path = path.startswith("/s/")
        sid = self.headers.get("X-Session-ID")
        if in_path:
            sid, _, rest = path[3:].partition("/")
            path = "/" + rest
        if sid is None:
            return None, path
        session = self.server.gateway.session(sid)
        if session is None and in_path:  # a header's id may be the client's own (verifiers sends one): not ours
            raise WireError(HTTPStatus.NOT_FOUND, f"no open session {sid!r} (its episode has ended)")
        return session, path

    def do_GET(self) -> None:
        try:
            _, path = self._route()
        except WireError as exc:
            self._send_json(exc.status, exc.body())
            return
        if path == "/health":
            self._send_json(HTTPStatus.OK, {"status": "ok"})
        elif path == "/v1/models":
            self._send_json(HTTPStatus.OK, models(self.server.gateway.limits))
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no such path {path!r}; POST {', '.join(ROUTES)} or GET /v1/models")

    def do_POST(self) -> None:
        started = time.monotonic()
        gateway = self.server.gateway
        try:
            session, path = self._route()
            if path not in ROUTES:
                self.close_connection = True
                raise WireError(HTTPStatus.NOT_FOUND, f"no such path {path!r}; POST one of {', '.join(ROUTES)}")
            self._check_token()
            payload = _json(self._read_body())
            route = ROUTES[path]
            call = route.read(payload, gateway.limits, gateway.tokenizer)
            done = gateway.submit(call, session)
            self._send_json(HTTPStatus.OK, route.answer(call, done, gateway.limits, gateway.tokenizer))
        except WireError as exc:
            self._send_json(exc.status, exc.body())
        except BadRequest as exc:
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == HTTPStatus.UNAUTHORIZED else None
            self._error(exc.status, str(exc), headers)
        except TimeoutError:
            self.close_connection = True
            return
        self._finish(started)


def _json(body: bytes) -> object:
    try:
        return json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(HTTPStatus.BAD_REQUEST, f"body is not valid UTF-8 JSON: {exc}") from None
