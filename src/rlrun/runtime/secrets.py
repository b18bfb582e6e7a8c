"""The one place that decides what a secret looks like, so that none reaches a log, a checkpoint, a stored
config, metrics or a tracker.

`redact_url` keeps what locates a service (scheme, host, port, path) and drops what can authenticate to it
(user info, query string, fragment). `redact_text` does that to every URL inside a string and masks the token
shapes people paste into flags and files (Hugging Face, OpenAI-style, GitHub, Slack, AWS, JWTs, bearer
headers, `key=value` pairs whose key names a secret). `is_secret_name` says which setting names hold secrets
outright (their whole value is masked).
"""

from __future__ import annotations

import re
import urllib.parse

MASK = "<redacted>"

# A URL ends at whitespace, a quote or bracket, or punctuation that closes the sentence around it.
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+?(?=[,.;:!?)\]]*(?:[\s'\"<>]|$))")
_SECRET_WORDS = (
    "token",
    "secret",
    "password",
    "passwd",
    "api_key",
    "apikey",
    "access_key",
    "authorization",
    "credential",
    "private_key",
)
_TOKENS = [
    re.compile(r"\bhf_[A-Za-z0-9]{20,}"),  # Hugging Face
    re.compile(r"\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{16,}"),  # OpenAI / Anthropic style
    re.compile(r"\b(?:ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{20,}|\bgithub_pat_[A-Za-z0-9_]{20,}"),  # GitHub
    re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"),  # Slack
    re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),  # AWS access key id
    re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),  # JWT
    re.compile(r"\b(?:wandb_)?(?:local-)?[0-9a-f]{40}\b"),  # W&B API keys (40 hex)
]
# `api_key=abc`, `"token": "abc"`, `--hf_token=abc`, `Authorization: Bearer abc`: the value goes.
_PAIR = re.compile(
    r"(?i)((?:[\w.-]*(?:" + "|".join(_SECRET_WORDS) + r")[\w.-]*)[\"']?\s*[:=]\s*[\"']?"
    r"(?:bearer\s+|basic\s+)?)([^\s\"',;&]+)"
)
_BEARER = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{8,}")


_NAME_WORDS = frozenset(
    {"token", "secret", "password", "passwd", "apikey", "credential", "credentials", "authorization"}
)
_NAME_PAIRS = frozenset({("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key")})


def is_secret_name(name: str) -> bool:
    """Whether a setting called `name` holds a secret (its whole value is masked): a word of it names one
    (hf_token, db_password, wandb_api_key), not merely contains one (max_tokens_per_turn, input_key)."""
    words = re.split(r"[_.\-]+", name.lower())
    nexts = words[1:] + [""]
    return any(w in _NAME_WORDS and not (w == "token" and n in ("id", "ids")) for w, n in zip(words, nexts)) or any(
        pair in _NAME_PAIRS for pair in zip(words, nexts)
    )


def redact_url(url: str) -> str:
    """`url` without user info, query string or fragment (each replaced by a mark where present)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:  # not a parsable URL: mask what follows the scheme rather than guess
        scheme = url.split("://", 1)[0]
        return f"{scheme}://{MASK}"
    host = parts.hostname or ""
    netloc = f"{MASK}@" if (parts.username or parts.password) else ""
    netloc += f"[{host}]" if ":" in host else host
    netloc += f":{port}" if port else ""
    query = MASK if parts.query else ""
    fragment = MASK if parts.fragment else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


def redact_text(text: str) -> str:
    """`text` with every URL redacted (redact_url), known token shapes and secret `key=value` values masked."""
    out = _URL.sub(lambda m: redact_url(m.group(0)), text)
    for pattern in _TOKENS:
        out = pattern.sub(MASK, out)
    out = _BEARER.sub(lambda m: f"{m.group(1)} {MASK}", out)
    return _PAIR.sub(lambda m: m.group(1) + MASK, out)


def redact_value(name: str, value: object) -> object:
    """A setting's value as it may be stored or shown: masked whole under a secret name, else strings (also
    inside lists and dicts) passed through redact_text."""
    if is_secret_name(name) and isinstance(value, str) and value:
        return MASK
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact_value(str(k), v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(name, v) for v in value)
    return value
