"""The Tinker API's HTTP transport on rank 0: the routes under /api/v1 the SDK calls, each handed to the front
(rlrun.tinker.server), the API key, long-polled futures, and the server's thread."""

from __future__ import annotations

import hmac
import json
import threading
import time
from http import HTTPStatus
from typing import Any

import tinker.types as tt

from rlrun.runtime.log import get_logger
from rlrun.serving.http_service import BadRequest as HttpError
from rlrun.serving.http_service import JsonHandler, JsonHTTPServer, clip_line
from rlrun.tinker.server import LONG_POLL_S, Front
from rlrun.tinker.wire import BadRequest, parse

_PREFIX = "/api/v1"


class TinkerHTTPServer(JsonHTTPServer):
    front: Front


class TinkerHandler(JsonHandler):
    """The routes of the Tinker API (everything under /api/v1 the SDK calls for training and sampling)."""

    server: TinkerHTTPServer

    def do_GET(self) -> None:
        started = time.monotonic()
        path = self.path.split("?", 1)[0]
        front = self.server.front
        try:
            route = path.removeprefix(_PREFIX + "/")
            if route not in ("healthz", "health"):  # liveness needs no key (load balancers, readiness probes)
                self._check_key()
            if route in ("healthz", "health"):
                answer: dict[str, Any] = {"status": "ok"}
            elif route == "get_server_capabilities":
                answer = front.capabilities()
            elif route.startswith("samplers/"):
                try:
                    answer = front.sampler(route.removeprefix("samplers/"))
                except KeyError:
                    raise HttpError(HTTPStatus.NOT_FOUND, f"unknown sampler {route[9:]!r}") from None
            else:
                raise HttpError(HTTPStatus.NOT_FOUND, f"rlrun.tinker does not serve GET {path}")
            self._send_json(HTTPStatus.OK, answer)
        except HttpError as exc:
            self._error(exc.status, str(exc))
        self._finish(started)

    def do_POST(self) -> None:
        started = time.monotonic()
        path = self.path.split("?", 1)[0]
        front = self.server.front
        try:
            self._check_key()
            route = path.removeprefix(_PREFIX + "/")
            body = self._read_body()
            if front.closed is not None and route not in ("retrieve_future", "telemetry", "session_heartbeat"):
                raise HttpError(HTTPStatus.GONE, front.closed)  # the SDK raises a 410 at once (a 503 it retries)
            if route == "retrieve_future":
                self._retrieve(_json_body(body))
            elif route == "forward_backward":
                self._send_json(HTTPStatus.OK, front.forward_backward(body, self.headers.get("Content-Encoding")))
            elif route.startswith("sessions/") and route.endswith("/finish"):
                self._send_json(HTTPStatus.OK, {})
            else:
                try:
                    self._send_json(HTTPStatus.OK, front.post(route, _json_body(body)))
                except KeyError:
                    raise HttpError(HTTPStatus.NOT_FOUND, f"rlrun.tinker does not serve POST {path}") from None
                if route == "telemetry":
                    # the SDK's report of a failure it is about to raise, which a failing job waits for
                    # (Futures.drain_failures): counted only once answered, as the SDK waits 30 s for an answer that
                    # a job gone before sending it never gives
                    front.futures.reported()
        except BadRequest as exc:  # the client's mistake, said in the job's log too (what the SDK raised, and why)
            get_logger(0).warning_once(f"rlrun.tinker refused POST {path}: {exc}")
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
        except HttpError as exc:
            self._error(exc.status, str(exc))
        except TimeoutError:
            self.close_connection = True
            return
        except Exception as exc:  # noqa: BLE001 - any other failure is still one JSON line, not a dropped socket
            get_logger(0).warning_once(f"rlrun.tinker: {path}: {type(exc).__name__}: {exc}")
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(exc).__name__}: {exc}")
        self._finish(started)

    def _retrieve(self, body: dict[str, Any]) -> None:
        req = parse(tt.FutureRetrieveRequest, body)
        try:
            result = self.server.front.futures.wait(req.request_id, LONG_POLL_S)
        except KeyError:
            raise HttpError(HTTPStatus.NOT_FOUND, f"unknown request_id {req.request_id!r}") from None
        if result is None:
            self._send_json(
                HTTPStatus.REQUEST_TIMEOUT, {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
            )
        elif result.error is not None:
            self._send_json(HTTPStatus.OK, {"error": clip_line(result.error, 2000), "category": result.category})
        else:
            self._send(HTTPStatus.OK, result.content_type, result.body)

    def _check_key(self) -> None:
        expected = self.server.front.api_key
        if expected is None:
            return
        given = self.headers.get("X-API-Key", "")
        if not hmac.compare_digest(given.encode("utf-8"), expected):
            self.close_connection = True
            raise HttpError(HTTPStatus.UNAUTHORIZED, "wrong or missing API key (X-API-Key: the job's --tinker_api_key)")


def _json_body(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body.decode("utf-8") or "{}")
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the body is not JSON ({exc})") from None
    if not isinstance(payload, dict):
        raise BadRequest("the body is not a JSON object")
    return payload


def start_server(front: Front, host: str, port: int, max_request_bytes: int) -> TinkerHTTPServer:
    """Bind (a taken port fails here, before the model is built) and serve from a daemon thread."""
    server = TinkerHTTPServer(
        (host, port),
        TinkerHandler,
        log_name="rlrun.tinker",
        token=None,
        token_env="TINKER_API_KEY",
        max_request_bytes=max_request_bytes,
        request_timeout=LONG_POLL_S + 30.0,
        quiet=True,
    )
    server.front = front
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True).start()
    return server
