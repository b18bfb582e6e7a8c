"""Record-level helpers of the SFT and preference loaders (rlrun.supervised.datasets): cutting a rendered
conversation into prompt and answer, OpenRLHF 0.11.2's EOS and truncation rules, and the accounting of dropped
records. Field access and chat rendering shared with PPO's prompts live in rlrun.data.records.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from rlrun.data.sources import DataSpec, read_sources
from rlrun.data.records import render, shown, where
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


def margin(row: Mapping[str, Any], where: str) -> float:
    value = row.get("margin")
    if value is None:
        return 0.0
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise DataError(f"{where} has 'margin' = {shown(value)}; a margin must be a number (or absent/null for 0).")


# ---------------------------------------------------------------------------------------------------------------
# Text assembly


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


def records(path: str | DataSpec, max_samples: int, max_len: int) -> list[Mapping[str, Any]]:
    """The first max_samples records of `path` (a DataSpec: sources, split and blend; a str: one source)."""
    if max_samples < 1:
        raise DataError(f"max_samples={max_samples} keeps no records; pass a positive number.")
    if max_len < 1:
        raise DataError(f"max_len={max_len} must be >= 1.")
    spec = path if isinstance(path, DataSpec) else DataSpec(path, flag="dataset")
    rows = read_sources(dataclasses.replace(spec, max_count=max_samples))
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
