"""JSON-over-HTTP service machinery shared by rlrun's small servers (reward, retriever).

Standard library only: a ThreadingHTTPServer whose handler answers JSON on every path, errors
included (`{"error": "one line"}`), bounds request bodies (413 before reading them) and socket
time (a stalled client is cut off), optionally requires `Authorization: Bearer <token>`, serves
`GET /health` without auth, writes one log line per request (method, path, status, batch size,
duration: never headers or bodies) and stops cleanly on SIGTERM/SIGINT.

A service subclasses JsonHandler: it names its POST paths and implements `handle_post`.
"""

from __future__ import annotations

import argparse
import hmac
import http.client
import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypeVar, cast

from rlrun.runtime.errors import RlrunError
from rlrun.runtime.pyfile import one_line

# ---- retries -----------------------------------------------------------------------------------------------------
# One JSON POST with bounded retries, shared by rlrun's HTTP clients (reward server, retriever).
#
# `post_once` makes one attempt and sorts its failure: AttemptFailed (connection error, timeout,
# HTTP 5xx: may heal, so retried) or RequestRejected (HTTP 4xx: the same request will fail again).
# `with_retries` repeats a callable on AttemptFailed with exponential backoff and raises
# RetriesExhausted with the last cause. Clients wrap both in their own RlrunError subclass.

T = TypeVar("T")


class AttemptFailed(Exception):
    """One attempt failed in a way that may heal (retried); the message is one line."""


class RequestRejected(Exception):
    """The server refused the request with an HTTP 4xx; retrying cannot help."""


class RetriesExhausted(Exception):
    """Every attempt failed; `last_error` is the last attempt's one-line cause."""

    def __init__(self, attempts: int, last_error: str) -> None:
        super().__init__(f"failed after {attempts} attempts: {last_error}")
        self.attempts = attempts
        self.last_error = last_error


def post_once(
    url: str, body: bytes, headers: dict[str, str], timeout_s: float, scrub: Callable[[str], str] = lambda text: text
) -> tuple[int, bytes]:
    """POST body once; return (status, response bytes) or raise AttemptFailed / RequestRejected.

    `scrub` removes secrets (a bearer token) from any text that ends up in a message."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        try:
            detail = scrub(" ".join(exc.read(300).decode("utf-8", "replace").split()))
        except (OSError, http.client.HTTPException):
            detail = ""
        message = f"HTTP {exc.code} {exc.reason}" + (f" ({detail})" if detail else "")
        if exc.code < 500:
            raise RequestRejected(message) from None
        raise AttemptFailed(message) from None
    except (OSError, http.client.HTTPException) as exc:  # URLError and timeouts are OSErrors
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, TimeoutError):
            raise AttemptFailed(f"timed out after {timeout_s:g} s") from None
        raise AttemptFailed(scrub(one_line(reason) if isinstance(reason, BaseException) else str(reason))) from None


def with_retries(attempt: Callable[[], T], *, retries: int, backoff_s: float) -> T:
    """Call `attempt` up to `retries` times, sleeping backoff_s * 2**(k-1) before retry k, while it
    raises AttemptFailed; any other exception passes through at once."""
    last_error = "no attempt made"
    for k in range(retries):
        if k:
            time.sleep(backoff_s * 2 ** (k - 1))
        try:
            return attempt()
        except AttemptFailed as exc:
            last_error = str(exc)
    raise RetriesExhausted(retries, last_error)


DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class BadRequest(Exception):
    """A client error, answered with its HTTP status and a one-line message."""

    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def clip_line(text: str, limit: int = 500) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


class JsonHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[JsonHandler],
        *,
        log_name: str,
        token: str | None,
        token_env: str,
        max_request_bytes: int,
        request_timeout: float,
        quiet: bool,
    ) -> None:
        self.log_name = log_name  # prefix of every request log line, e.g. "reward-server"
        self.token = token.encode("utf-8") if token else None
        self.token_env = token_env  # named in 401 answers so the client knows what to set
        self.max_request_bytes = max_request_bytes
        self.request_timeout = request_timeout
        self.quiet = quiet
        super().__init__(address, handler)


class JsonHandler(BaseHTTPRequestHandler):
    """Routing, body reading, auth, errors and logging; subclasses set `post_paths` and `handle_post`."""

    server: JsonHTTPServer
    protocol_version = "HTTP/1.1"
    sys_version = ""
    # TCP_NODELAY: an answer's headers and body leave as two writes; with Nagle on, the body waits for the client's
    # delayed ACK of the headers (~40 ms a request on a kept-alive connection)
    disable_nagle_algorithm = True
    # The accepted POST paths; the first is the one named in error messages.
    post_paths: tuple[str, ...] = ()

    def handle_post(self, path: str, payload: object) -> tuple[dict, int | None]:
        """Answer one parsed JSON body: (response body, batch size for the log line or None).

        Raise BadRequest for the client's mistakes; an RlrunError becomes a 500 with its message."""
        raise NotImplementedError

    def health(self) -> dict:
        return {"status": "ok"}

    def setup(self) -> None:
        # Bounds every socket read and write of this connection (slow or stalled clients).
        self.timeout = self.server.request_timeout  # type: ignore[misc]  # typeshed: a ClassVar; setup() reads self's
        super().setup()

    # -- responses -----------------------------------------------------------------------------
    def _send_json(self, status: HTTPStatus, body: dict, headers: dict[str, str] | None = None) -> None:
        self._send(status, "application/json", json.dumps(body, allow_nan=False).encode("utf-8"), headers)

    def _send(self, status: HTTPStatus, content_type: str, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
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
        self._send_json(status, {"error": clip_line(message)}, headers)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own errors (malformed request line, 414, 501) as JSON too.
        self.close_connection = True
        try:
            status = HTTPStatus(code)
        except ValueError:
            status = HTTPStatus.BAD_REQUEST
        self._error(status, message or status.phrase)

    def log_message(self, format: str, *args: object) -> None:
        if not self.server.quiet:
            sys.stderr.write(
                f"[{self.server.log_name} {time.strftime('%H:%M:%S')}] {self.address_string()} {format % args}\n"
            )

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # one line per request is written in _finish, with the batch size and duration

    def _finish(self, started: float, batch: int | None = None) -> None:
        # Only method, path, status, size and time: never headers (the token) or bodies.
        what = f" batch={batch}" if batch is not None else ""
        self.log_message(
            "%s %s -> %s%s in %.3fs",
            self.command,
            self.path.split("?", 1)[0],
            getattr(self, "_status", "?"),
            what,
            time.monotonic() - started,
        )

    # -- routing -------------------------------------------------------------------------------
    def do_GET(self) -> None:
        started = time.monotonic()
        path = self.path.split("?", 1)[0]
        main_path = self.post_paths[0]
        if path == "/health":
            self._send_json(HTTPStatus.OK, self.health())
        elif path == main_path:
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"use POST {main_path} with a JSON body", {"Allow": "POST"})
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no such path {path!r}; use POST {main_path} or GET /health")
        if path != "/health":
            self._finish(started)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_POST(self) -> None:
        started = time.monotonic()
        batch = None
        try:
            path = self.path.split("?", 1)[0]
            if path not in self.post_paths:
                self.close_connection = True
                raise BadRequest(HTTPStatus.NOT_FOUND, f"no such path {path!r}; use POST {self.post_paths[0]}")
            self._check_token()
            body = self._read_body()
            try:
                payload = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
            except (UnicodeDecodeError, ValueError) as exc:
                raise BadRequest(HTTPStatus.BAD_REQUEST, f"body is not valid UTF-8 JSON: {exc}") from None
            answer, batch = self.handle_post(path, payload)
            self._send_json(HTTPStatus.OK, answer)
        except BadRequest as exc:
            headers = {"WWW-Authenticate": "Bearer"} if exc.status == HTTPStatus.UNAUTHORIZED else None
            self._error(exc.status, str(exc), headers)
        except RlrunError as exc:
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
            raise BadRequest(
                HTTPStatus.UNAUTHORIZED, f"missing or wrong bearer token (set {self.server.token_env} on the client)"
            )

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
            raise BadRequest(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"request body of {length} bytes is over the limit of {self.server.max_request_bytes} "
                "bytes; send smaller batches or raise --max_request_bytes",
            )
        body = self.rfile.read(length)
        if len(body) != length:
            self.close_connection = True
            raise BadRequest(HTTPStatus.BAD_REQUEST, f"body ended after {len(body)} of {length} bytes")
        return body


def add_server_arguments(parser: argparse.ArgumentParser, *, default_port: int) -> None:
    """The flags every JSON service takes: --host, --port, --max_request_bytes, --request_timeout, --quiet."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="Address to listen on; 0.0.0.0 for every interface (default: 127.0.0.1)."
    )
    parser.add_argument(
        "--port", type=int, default=default_port, help=f"Port; 0 picks a free one (default: {default_port})."
    )
    parser.add_argument(
        "--max_request_bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"Largest accepted request body; larger ones get 413 (default: {DEFAULT_MAX_REQUEST_BYTES}).",
    )
    parser.add_argument(
        "--request_timeout",
        type=float,
        default=60.0,
        help="Seconds a client may take to send a request or receive the answer (socket timeout; default: 60).",
    )
    parser.add_argument("--quiet", action="store_true", help="No per-request log lines.")


def server_arguments_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the shared flags, or None."""
    if args.max_request_bytes < 1 or args.request_timeout <= 0 or not 0 <= args.port < 65536:
        return "need --max_request_bytes >= 1, --request_timeout > 0 and 0 <= --port < 65536"
    return None


def serve(
    prog: str, make_server: Callable[[], JsonHTTPServer], *, host: str, port: int, details: str, exposes: str
) -> int:
    """Bind, announce, serve until SIGTERM/SIGINT, close. Returns the process exit code.

    prog: "rlrun reward server"; details: the banner's parenthesis after the URL; exposes: what anyone
    could do on a non-loopback address without a token ("call the reward function")."""
    try:
        server = make_server()
    except OSError as exc:
        print(f"{prog}: error: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 2
    bound_host, bound_port = cast("tuple[str, int]", server.server_address[:2])  # a TCP socket's: the host is a str
    if server.token is None and host not in LOOPBACK:
        print(
            f"{prog}: warning: listening on {host} without {server.token_env}; anyone who can reach "
            f"this port can {exposes}",
            file=sys.stderr,
        )

    def stop(signum: int, _frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    auth = "bearer token required" if server.token else "no auth"
    print(f"{prog}: listening on http://{bound_host}:{bound_port} ({details}; {auth})", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
    print(f"{prog}: stopped", flush=True)
    return 0
