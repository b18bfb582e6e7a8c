"""One JSON POST with bounded retries, shared by rlrun's HTTP clients (reward server, retriever).

`post_once` makes one attempt and sorts its failure: AttemptFailed (connection error, timeout,
HTTP 5xx: may heal, so retried) or RequestRejected (HTTP 4xx: the same request will fail again).
`with_retries` repeats a callable on AttemptFailed with exponential backoff and raises
RetriesExhausted with the last cause. Clients wrap both in their own RlrunError subclass.
"""

from __future__ import annotations

import http.client
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import TypeVar

from rlrun.runtime.pyfile import one_line

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


def post_once(url: str, body: bytes, headers: dict[str, str], timeout_s: float,
              scrub: Callable[[str], str] = lambda text: text) -> tuple[int, bytes]:
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
