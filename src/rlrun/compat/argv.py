"""Token-level helpers shared by the peer flag translators."""

from __future__ import annotations

import re
from typing import Literal, Sequence, Union

from rlrun.runtime.errors import ConfigError

# How many values a flag takes: a count, "*" (any number), "+" (at least one), "?" (an optional one).
Nargs = Union[int, Literal["*", "+", "?"]]

# A Hydra override: optional + / ++ / ~ prefix, a dotted key, '=' and a value (possibly empty).
_OVERRIDE = re.compile(r"^(\+\+|\+|~)?([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_0-9][A-Za-z0-9_]*)*)=(.*)$", re.S)


def split_override(token: str) -> tuple[str, str, str] | None:
    """(prefix, key, raw value) of a verl/Hydra ``key=value`` token, or None if it is not one."""
    if token.startswith("-"):
        return None
    match = _OVERRIDE.match(token)
    return (match.group(1) or "", match.group(2), match.group(3)) if match else None


def is_value(token: str) -> bool:
    """May this token be a flag's value (not a flag, not a verl override)?"""
    return not token.startswith("--") and split_override(token) is None


def take_values(argv: Sequence[str], start: int, nargs: Nargs, flag: str) -> list[str]:
    """The values of `flag` beginning at argv[start]; a missing required value is a ConfigError naming the flag."""
    if nargs == "?":
        return [argv[start]] if start < len(argv) and is_value(argv[start]) else []
    if nargs in ("*", "+"):
        end = start
        while end < len(argv) and is_value(argv[end]):
            end += 1
        if nargs == "+" and end == start:
            raise ConfigError(f"{flag} needs at least one value")
        return list(argv[start:end])
    count = int(nargs)
    values = list(argv[start:start + count])
    # A value may legitimately start with '-' (negative numbers), but never with '--'.
    if len(values) < count or any(v.startswith("--") for v in values):
        raise ConfigError(f"{flag} needs {count} value{'s' if count > 1 else ''}")
    return values
