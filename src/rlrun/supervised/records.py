"""Record-level helpers shared by the SFT and preference loaders (rlrun.supervised.datasets): field access that
names the offending record, chat-message checks and rendering, OpenRLHF 0.11.2's EOS and truncation rules, and
the accounting of dropped records.
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from rlrun.data.prompts import read_rows
from rlrun.runtime.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Loaded(Generic[T]):
    samples: list[T]
    dropped: int  # records left out (too long for max_len, empty, ...) — the lead logs it
    truncated: int  # records cut to max_len


# ---------------------------------------------------------------------------------------------------------------
# Record fields


def where(path: str, index: int) -> str:
    return f"{path}: record {index}"


def field(row: Mapping[str, Any], key: str, flag: str, where: str) -> Any:
    if key not in row:
        present = [str(name) for name in row]
        close = difflib.get_close_matches(key, present, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise DataError(f"{where} has no {flag} {key!r}; keys present: {present}.{hint} Set --{flag} to one of them.")
    return row[key]


def shown(value: Any) -> str:
    return f"{str(value)[:80]!r} ({type(value).__name__})"


def looks_like_messages(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and all(isinstance(m, Mapping) for m in value)


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


def margin(row: Mapping[str, Any], where: str) -> float:
    value = row.get("margin")
    if value is None:
        return 0.0
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise DataError(f"{where} has 'margin' = {shown(value)}; a margin must be a number (or absent/null for 0).")


# ---------------------------------------------------------------------------------------------------------------
# Text assembly


def render(tokenizer: PreTrainedTokenizerBase, messages: Messages, generation_prompt: bool, where: str) -> str:
    from jinja2 import TemplateError  # lazy: transformers' own dependency, needed only with a chat template

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except TemplateError as exc:
        raise DataError(f"{where}: the chat template failed on {str(messages)[:120]!r}: {exc}") from exc
    if not isinstance(text, str):
        raise DataError(f"{where}: the chat template returned {type(text).__name__}, not text; check the template.")
    return text


def after(full: str, prompt: str, where: str, what: str) -> str:
    """The text of `full` after `prompt`; OpenRLHF slices by length, which is only right when it is a prefix."""
    if not full.startswith(prompt):
        raise DataError(
            f"{where}: the rendered prompt {prompt[-80:]!r} is not the beginning of the rendered {what} "
            f"{full[:160]!r}; the answer cannot be cut out of it. The conversation must end with the assistant's answer, "
            "and the chat template (--tokenizer_chat_template) must render the earlier turns with "
            "add_generation_prompt as a prefix of the whole conversation."
        )
    return full[len(prompt) :]


def chat_pair(
    tokenizer: PreTrainedTokenizerBase, prompt: Messages, answer: Messages, where: str, what: str
) -> tuple[str, str]:
    prompt_text = render(tokenizer, prompt, True, where)
    return prompt_text, after(render(tokenizer, prompt + answer, False, where), prompt_text, where, what)


def eos_terminated(text: str, eos_token: str) -> str:
    # OpenRLHF's rule, space included: a template that already ends turns with EOS gets no second one.
    text = text.rstrip("\n")
    return text if text.endswith(eos_token) else f"{text} {eos_token}"


# ---------------------------------------------------------------------------------------------------------------
# Tokenization


def encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def cut(ids: list[int], max_len: int, eos_id: int) -> tuple[list[int], bool]:
    """The first max_len ids with EOS as the last one (OpenRLHF overwrites it even when nothing was cut)."""
    kept = ids[:max_len]
    if kept:
        kept[-1] = eos_id
    return kept, len(ids) > max_len


def common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


# ---------------------------------------------------------------------------------------------------------------
# Loading


def records(path: str, max_samples: int, max_len: int) -> list[Mapping[str, Any]]:
    if max_samples < 1:
        raise DataError(f"max_samples={max_samples} keeps no records; pass a positive number.")
    if max_len < 1:
        raise DataError(f"max_len={max_len} must be >= 1.")
    rows = read_rows(path)
    if not rows:
        raise DataError(f"Dataset {path!r} is empty; it needs at least one record.")
    rows = rows[:max_samples]  # OpenRLHF: select(range(min(max_samples, len)))
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise DataError(f"{where(path, index)} is {shown(row)}; each record must be an object (key -> value).")
    return rows


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, apply_chat_template: bool, needs_eos: bool) -> None:
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "--apply_chat_template is set but the tokenizer has no chat_template; pass one with "
            "--tokenizer_chat_template, or unset --apply_chat_template and use --input_template."
        )
    if needs_eos and (tokenizer.eos_token is None or tokenizer.eos_token_id is None):
        raise DataError(
            "The tokenizer has no eos_token, which OpenRLHF appends to every sample; "
            "use a tokenizer that defines one (or set tokenizer.eos_token)."
        )


def all_dropped(path: str, total: int, reasons: Counter[str], max_len: int) -> DataError:
    listed = ", ".join(f"{count} {reason}" for reason, count in reasons.most_common())
    return DataError(
        f"Every one of the {total} records of {path!r} was dropped ({listed}); nothing is left to train on. "
        f"Raise --max_len (now {max_len}) if prompts are too long, or check the keys and values of the records."
    )


def finish(path: str, total: int, samples: list[T], reasons: Counter[str], truncated: int, max_len: int) -> Loaded[T]:
    if not samples:
        raise all_dropped(path, total, reasons, max_len)
    return Loaded(samples=samples, dropped=sum(reasons.values()), truncated=truncated)
