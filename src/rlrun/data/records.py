"""Reading one field of one record the way users' datasets hold it, and rendering chat messages.

Shared by PPO's prompts (rlrun.data.prompts) and the SFT/RM/DPO loaders (rlrun.supervised.datasets):
- a key may be a dotted path into nested fields (`reward_model.ground_truth`, verl's and Search-R1's label), tried
  after the literal key so a column named `a.b` still wins;
- a chat is a list of `{"role", "content"}` messages, as OpenRLHF's `context_messages`, verl's `prompt` column
  (parquet's nested arrays arrive as lists of dicts) or JSON text of the same;
- every error names the file, the record (counted from 0) and the key.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlrun.runtime.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Messages = list[dict[str, Any]]
MISSING = object()  # lookup() of a key a record lacks


def where(path: str, index: int) -> str:
    return f"{path}: record {index}"


def lookup(row: Mapping[str, Any], key: str) -> Any:
    """row[key], else the dotted path `a.b.c` through nested mappings; MISSING when neither exists."""
    if key in row:
        return row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return MISSING
        value = value[part]
    return value


def field(row: Mapping[str, Any], key: str, flag: str, where: str) -> Any:
    value = lookup(row, key)
    if value is MISSING:
        present = [str(name) for name in row]
        close = difflib.get_close_matches(key, present, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        nested = "" if "." not in key else f" (nor the nested field {key!r})"
        raise DataError(f"{where} has no {flag} {key!r}{nested}; keys present: {present}.{hint} Set --{flag} to one of "
                        "them (a dotted path reaches nested fields).")
    return value


def shown(value: Any) -> str:
    return f"{str(value)[:80]!r} ({type(value).__name__})"


def looks_like_messages(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and all(isinstance(m, Mapping) for m in value)


def parsed_messages(value: Any) -> Any:
    """`value`, or the message list a JSON string of one decodes to (datasets that store chats as JSON text)."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            decoded = json.loads(value)
        except json.JSONDecodeError:
            return value
        if looks_like_messages(decoded) and decoded and all("role" in m for m in decoded):
            return decoded
    return value


def string(value: Any, key: str, where: str) -> str:
    if isinstance(value, str):
        return value
    hint = (
        " It looks like chat messages: pass --apply_chat_template to render them with the tokenizer's chat template."
        if looks_like_messages(value) and value
        else ""
    )
    raise DataError(f"{where} has {key!r} = {shown(value)}; without --apply_chat_template it must be a string.{hint}")


def messages(value: Any, key: str, where: str, text_role: str | None) -> Messages:
    """A chat message list; a plain string becomes one `text_role` message when text_role is given."""
    value = parsed_messages(value)
    if isinstance(value, str) and text_role is not None:
        return [{"role": text_role, "content": value}]
    expected = 'a list of {"role": ..., "content": ...} messages' + (" or a string" if text_role else "")
    if not looks_like_messages(value) or not value:
        raise DataError(f"{where} has {key!r} = {shown(value)}; with --apply_chat_template it must be {expected}.")
    messages = [dict(message) for message in value]
    for position, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or "content" not in message:
            raise DataError(
                f"{where} has {key!r} whose message {position} is {shown(message)}; "
                f'each message needs a string "role" and a "content" (OpenRLHF\'s chat format).'
            )
    return messages


def render(tokenizer: PreTrainedTokenizerBase, messages: Messages, generation_prompt: bool, where: str,
           template_kwargs: Mapping[str, Any] | None = None) -> str:
    """`messages` through the tokenizer's chat template as text (verl's data.apply_chat_template_kwargs, e.g.
    `enable_thinking`, go to the template)."""
    from jinja2 import TemplateError  # lazy: transformers' own dependency, needed only with a chat template

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                             **dict(template_kwargs or {}))
    except TemplateError as exc:
        raise DataError(f"{where}: the chat template failed on {str(messages)[:120]!r}: {exc}") from exc
    if not isinstance(text, str):
        raise DataError(f"{where}: the chat template returned {type(text).__name__}, not text; check the template.")
    return text


def plain(value: Any) -> Any:
    """A value as plain Python (numpy arrays and scalars from parquet become lists and numbers), so it reaches a
    reward function as the object it is and an HTTP reward as JSON."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    tolist = getattr(value, "tolist", None)
    if callable(tolist) and not isinstance(value, (str, bytes)):
        return plain(tolist())
    return value
