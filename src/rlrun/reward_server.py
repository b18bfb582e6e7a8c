"""A reward server for `--remote_rm_url http://HOST:PORT/reward` (OpenRLHF's request format).

    python -m rlrun.reward_server --reward_file my_reward.py --host 0.0.0.0 --port 5000

POST /reward   {"query": [...], "prompts": [...], "labels": [...]}
               -> 200 {"rewards": [...], "scores": [...], "extra_logs": {...}}
GET  /health   -> 200 {"status": "ok"}

The reward file defines `reward_func(queries, prompts, labels)` (the same file works locally as
`--remote_rm_url my_reward.py`); its output is validated exactly as in training. Standard library
only, JSON only (never pickle). Set RLRUN_REWARD_TOKEN to require `Authorization: Bearer <token>`
on /reward (training sends it from the same variable). Errors are JSON `{"error": "..."}`:
400 bad request, 401 missing/wrong token, 404/405 wrong path or method, 411 no Content-Length,
413 body over --max_request_bytes, 500 the reward function failed or returned bad values.
"""

from __future__ import annotations

import argparse
import hmac
import json
import math
import os
import signal
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Sequence

from rlrun.errors import RewardError
from rlrun.roles.reward_fn import TOKEN_ENV, RewardFunction, load_reward_function

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class BadRequest(Exception):
    """A client error, answered with its HTTP status and a one-line message."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def _one_line(text: str, limit: int = 500) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_batch(payload: object) -> tuple[list[str], list[str], list[str | None]]:
    """Validate an OpenRLHF reward request; missing prompts default to "" and labels to None."""
    if not isinstance(payload, dict):
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"request body must be a JSON object, got {type(payload).__name__}")
    unknown = sorted(set(payload) - {"query", "queries", "prompts", "labels"})
    if unknown:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"unknown key(s) {unknown}; expected 'query', 'prompts', 'labels'")
    queries = payload.get("query", payload.get("queries"))
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "'query' must be a list of strings (prompt + response text)")
    n = len(queries)
    prompts = payload.get("prompts")
    if prompts is None:
        prompts = [""] * n
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "'prompts' must be a list of strings")
    labels = payload.get("labels")
    if labels is None:
        labels = [None] * n
    if not isinstance(labels, list) or not all(label is None or isinstance(label, str) for label in labels):
        raise BadRequest(HTTPStatus.BAD_REQUEST, "'labels' must be a list of strings or nulls")
    if not len(prompts) == len(labels) == n:
        raise BadRequest(HTTPStatus.BAD_REQUEST, f"got {n} queries, {len(prompts)} prompts and {len(labels)} labels; "
                                                 "send one prompt and one label (or null) per query")
    return queries, prompts, labels


class RewardHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], reward: RewardFunction, *, token: str | None,
                 max_request_bytes: int, request_timeout: float, concurrency: int, quiet: bool) -> None:
        self.reward = reward
        self.token = token.encode("utf-8") if token else None
        self.max_request_bytes = max_request_bytes
        self.request_timeout = request_timeout
        self.quiet = quiet
        # Reward functions are often not thread-safe; by default one batch is scored at a time.
        self.slots = threading.BoundedSemaphore(concurrency)
        super().__init__(address, RewardHandler)


class RewardHandler(BaseHTTPRequestHandler):
    server: RewardHTTPServer
    protocol_version = "HTTP/1.1"
    server_version = "rlrun-reward-server"
    sys_version = ""

    def setup(self) -> None:
        # Bounds every socket read and write of this connection (slow or stalled clients).
        self.timeout = self.server.request_timeout
        super().setup()

    # -- responses -----------------------------------------------------------------------------
    def _send_json(self, status: HTTPStatus, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body, allow_nan=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self._status = int(status)

    def _error(self, status: HTTPStatus, message: str, headers: dict[str, str] | None = None) -> None:
        self._send_json(status, {"error": _one_line(message)}, headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own errors (malformed request line, 414, 501) as JSON too.
        self.close_connection = True
        try:
            status = HTTPStatus(code)
        except ValueError:
            status = HTTPStatus.BAD_REQUEST
        self._error(status, message or status.phrase)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - base class signature
        if not self.server.quiet:
            sys.stderr.write(f"[reward-server {time.strftime('%H:%M:%S')}] {self.address_string()} {format % args}\n")

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # one line per request is written in _finish, with the batch size and duration

    def _finish(self, started: float, batch: int | None = None) -> None:
        # Only method, path, status, size and time: never headers (the token) or bodies.
        what = f" batch={batch}" if batch is not None else ""
        self.log_message("%s %s -> %s%s in %.3fs", self.command, self.path.split("?", 1)[0],
                         getattr(self, "_status", "?"), what, time.monotonic() - started)

    # -- routing -------------------------------------------------------------------------------
    def do_GET(self) -> None:
        started = time.monotonic()
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._send_json(HTTPStatus.OK, {"status": "ok"})
        elif path == "/reward":
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, "use POST /reward with a JSON body", {"Allow": "POST"})
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no such path {path!r}; use POST /reward or GET /health")
        if path != "/health":
            self._finish(started)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_POST(self) -> None:
        started = time.monotonic()
        batch = None
        try:
            path = self.path.split("?", 1)[0]
            if path not in ("/reward", "/get_reward"):
                self.close_connection = True
                raise BadRequest(HTTPStatus.NOT_FOUND, f"no such path {path!r}; use POST /reward")
            self._check_token()
            body = self._read_body()
            try:
                payload = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
            except (UnicodeDecodeError, ValueError) as exc:
                raise BadRequest(HTTPStatus.BAD_REQUEST, f"body is not valid UTF-8 JSON: {exc}") from None
            queries, prompts, labels = parse_batch(payload)
            batch = len(queries)
            with self.server.slots:
                result = self.server.reward(queries, prompts, labels)
            self._send_json(HTTPStatus.OK, {
                "rewards": result.rewards.tolist(),
                "scores": result.scores.tolist(),
                "extra_logs": {k: v for k, v in result.extra_logs.items() if math.isfinite(v)},
            })
        except BadRequest as exc:
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == HTTPStatus.UNAUTHORIZED else None
            self._error(exc.status, str(exc), headers)
        except RewardError as exc:
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, str(exc))
        except TimeoutError:
            self.close_connection = True
            return  # the client stopped sending; nobody is left to answer
        except Exception as exc:  # noqa: BLE001 - any other failure is still one JSON line, not a dropped socket
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(exc).__name__}: {exc}")
        self._finish(started, batch)

    def _check_token(self) -> None:
        expected = self.server.token
        if expected is None:
            return
        header = self.headers.get("Authorization", "")
        scheme, _, given = header.partition(" ")
        # compare_digest on bytes: constant time, and no TypeError for non-ASCII input.
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("utf-8"), expected):
            self.close_connection = True  # the body stays unread
            raise BadRequest(HTTPStatus.UNAUTHORIZED, f"missing or wrong bearer token (set {TOKEN_ENV} on the client)")

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise BadRequest(HTTPStatus.LENGTH_REQUIRED, "chunked bodies are not accepted; send Content-Length")
        raw = self.headers.get("Content-Length")
        if raw is None:
            self.close_connection = True
            raise BadRequest(HTTPStatus.LENGTH_REQUIRED, "Content-Length header is required")
        try:
            length = int(raw)
            if length < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"invalid Content-Length {raw[:40]!r}") from None
        if length > self.server.max_request_bytes:
            self.close_connection = True  # do not read (or wait for) the oversized body
            raise BadRequest(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                             f"request body of {length} bytes is over the limit of {self.server.max_request_bytes} "
                             "bytes; send smaller batches or raise --max_request_bytes")
        body = self.rfile.read(length)
        if len(body) != length:
            self.close_connection = True
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"body ended after {len(body)} of {length} bytes")
        return body


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rlrun.reward_server",
        description="Serve reward_func(queries, prompts, labels) from a Python file over HTTP for "
                    "--remote_rm_url http://HOST:PORT/reward (OpenRLHF's request and response format).")
    parser.add_argument("--reward_file", required=True, help="Python file defining reward_func(queries, prompts, labels).")
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on; 0.0.0.0 for every interface (default: 127.0.0.1).")
    parser.add_argument("--port", type=int, default=5000, help="Port; 0 picks a free one (default: 5000).")
    parser.add_argument("--max_request_bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help=f"Largest accepted request body; larger ones get 413 (default: {DEFAULT_MAX_REQUEST_BYTES}).")
    parser.add_argument("--request_timeout", type=float, default=60.0,
                        help="Seconds a client may take to send a request or receive the answer (socket timeout; default: 60).")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="Batches scored at the same time (default 1: reward functions need not be thread-safe).")
    parser.add_argument("--quiet", action="store_true", help="No per-request log lines.")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.max_request_bytes < 1 or args.request_timeout <= 0 or args.concurrency < 1 or not 0 <= args.port < 65536:
        print("rlrun reward server: error: need --max_request_bytes >= 1, --request_timeout > 0, --concurrency >= 1 "
              "and 0 <= --port < 65536", file=sys.stderr)
        return 2
    if not args.reward_file.strip().endswith(".py"):
        print("rlrun reward server: error: --reward_file must be a .py file defining reward_func", file=sys.stderr)
        return 2
    try:
        reward = load_reward_function(args.reward_file)
    except RewardError as exc:
        print(f"rlrun reward server: error: {exc}", file=sys.stderr)
        return 2
    token = os.environ.get(TOKEN_ENV) or None
    try:
        server = RewardHTTPServer((args.host, args.port), reward, token=token, max_request_bytes=args.max_request_bytes,
                                  request_timeout=args.request_timeout, concurrency=args.concurrency, quiet=args.quiet)
    except OSError as exc:
        print(f"rlrun reward server: error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    host, port = server.server_address[:2]
    if token is None and args.host not in LOOPBACK:
        print(f"rlrun reward server: warning: listening on {args.host} without {TOKEN_ENV}; anyone who can reach "
              "this port can call the reward function", file=sys.stderr)

    def stop(signum: int, _frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    auth = "bearer token required" if token else "no auth"
    print(f"rlrun reward server: listening on http://{host}:{port} (POST /reward, GET /health; "
          f"reward file {args.reward_file}; {auth})", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    print("rlrun reward server: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
