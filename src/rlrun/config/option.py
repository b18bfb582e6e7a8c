"""`opt`: how every config field is declared (its default and its help text, which is its flag's help)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, *, secret: bool = False, metavar: str | None = None) -> Any:
    """A config field with its help text (every flag has one)."""
    meta = {"help": help, "secret": secret, "metavar": metavar}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
