"""SFT and preference-pair records -> token ids, with OpenRLHF 0.11.2's text assembly, filtering and truncation.

The text of a sample is built as OpenRLHF's SFTDataset / RewardDataset build it:

- plain text: the prompt is `input_template.format(record[input_key])` (or the record's prompt as is); the
  sample text is `(prompt + response).rstrip("\\n")`, then `" " + eos_token` unless it already ends with EOS;
- chat messages (apply_chat_template): the prompt is the conversation before the answer rendered with
  add_generation_prompt=True, the response is the rest of the rendered whole conversation.

The whole sample text is tokenised once (no special tokens added), cut to its first max_len ids, and its last
id set to EOS (OpenRLHF's "avoid EOS truncation"). The prompt length is the length of the prompt text
tokenised alone, and the split into `prompt` / `response` ids is taken at that position of the whole
sample's ids. So prompt + response are exactly the ids OpenRLHF feeds the model, and the response ids are
exactly the positions OpenRLHF's loss mask covers, even where a tokenizer merges tokens across the
prompt/response boundary (there the first response token can sit in `prompt`, as it does in OpenRLHF).

Filtering (records counted in Loaded.dropped) and truncation (Loaded.truncated), as OpenRLHF:
- SFT: a record is dropped when its prompt text or response text is empty, or its prompt alone is
  >= max_len - 2 tokens; a longer sample is cut to max_len with EOS as its last id.
- SFT pretrain_mode: nothing is masked, templated or appended; the text is cut to max_len.
- DPO: a record is dropped when its prompt is >= max_len - 2 tokens; chosen/rejected samples are cut.
- reward model: nothing is dropped for length; samples are cut.
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from rlrun.data import format_prompt, read_rows
from rlrun.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")

PairTask = Literal["reward_model", "dpo"]
"""Which OpenRLHF trainer's pair semantics: DPO drops long prompts and splits chat pairs at their shared prompt."""

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Completion:
    """One SFT sample: the loss is taken on `response` only."""

    prompt: list[int]  # token ids the loss skips (empty in pretrain_mode)
    response: list[int]  # token ids trained on (as OpenRLHF: the output text + EOS where OpenRLHF adds it)


@dataclass(frozen=True)
class Preference:
    """One preference pair; the model inputs are prompt + chosen and prompt + rejected."""

    prompt: list[int]
    chosen: list[int]  # response ids of the chosen answer
    rejected: list[int]  # response ids of the rejected answer
    margin: float = 0.0  # the record's "margin" field (OpenRLHF's RM margin loss); 0 when absent or for DPO


@dataclass(frozen=True)
class Loaded(Generic[T]):
    samples: list[T]
    dropped: int  # records left out (too long for max_len, empty, ...) — the lead logs it
    truncated: int  # records cut to max_len


# ---------------------------------------------------------------------------------------------------------------
# Record fields


def _where(path: str, index: int) -> str:
    return f"{path}: record {index}"


def _field(row: Mapping[str, Any], key: str, flag: str, where: str) -> Any:
    if key not in row:
        present = [str(name) for name in row]
        close = difflib.get_close_matches(key, present, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise DataError(f"{where} has no {flag} {key!r}; keys present: {present}.{hint} Set --{flag} to one of them.")
    return row[key]


def _shown(value: Any) -> str:
    return f"{str(value)[:80]!r} ({type(value).__name__})"


def _looks_like_messages(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str) and all(isinstance(m, Mapping) for m in value)


def _string(value: Any, key: str, where: str) -> str:
    if isinstance(value, str):
        return value
    hint = (
        " It looks like chat messages: pass --apply_chat_template to render them with the tokenizer's chat template."
        if _looks_like_messages(value) and value
        else ""
    )
    raise DataError(f"{where} has {key!r} = {_shown(value)}; without --apply_chat_template it must be a string.{hint}")


def _messages(value: Any, key: str, where: str, text_role: str | None) -> Messages:
    """A chat message list; a plain string becomes one `text_role` message when text_role is given."""
    if isinstance(value, str) and text_role is not None:
        return [{"role": text_role, "content": value}]
    expected = 'a list of {"role": ..., "content": ...} messages' + (" or a string" if text_role else "")
    if not _looks_like_messages(value) or not value:
        raise DataError(f"{where} has {key!r} = {_shown(value)}; with --apply_chat_template it must be {expected}.")
    messages = [dict(message) for message in value]
    for position, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or "content" not in message:
            raise DataError(
                f"{where} has {key!r} whose message {position} is {_shown(message)}; "
                f'each message needs a string "role" and a "content" (OpenRLHF\'s chat format).'
            )
    return messages


def _margin(row: Mapping[str, Any], where: str) -> float:
    value = row.get("margin")
    if value is None:
        return 0.0
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise DataError(f"{where} has 'margin' = {_shown(value)}; a margin must be a number (or absent/null for 0).")


# ---------------------------------------------------------------------------------------------------------------
# Text assembly


def _render(tokenizer: PreTrainedTokenizerBase, messages: Messages, generation_prompt: bool, where: str) -> str:
    from jinja2 import TemplateError  # lazy: transformers' own dependency, needed only with a chat template

    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except TemplateError as exc:
        raise DataError(f"{where}: the chat template failed on {str(messages)[:120]!r}: {exc}") from exc
    if not isinstance(text, str):
        raise DataError(f"{where}: the chat template returned {type(text).__name__}, not text; check the template.")
    return text


def _after(full: str, prompt: str, where: str, what: str) -> str:
    """The text of `full` after `prompt`; OpenRLHF slices by length, which is only right when it is a prefix."""
    if not full.startswith(prompt):
        raise DataError(
            f"{where}: the rendered prompt {prompt[-80:]!r} is not the beginning of the rendered {what} "
            f"{full[:160]!r}; the answer cannot be cut out of it. The conversation must end with the assistant's answer, "
            "and the chat template (--tokenizer_chat_template) must render the earlier turns with "
            "add_generation_prompt as a prefix of the whole conversation."
        )
    return full[len(prompt) :]


def _chat_pair(
    tokenizer: PreTrainedTokenizerBase, prompt: Messages, answer: Messages, where: str, what: str
) -> tuple[str, str]:
    prompt_text = _render(tokenizer, prompt, True, where)
    return prompt_text, _after(_render(tokenizer, prompt + answer, False, where), prompt_text, where, what)


def _eos_terminated(text: str, eos_token: str) -> str:
    # OpenRLHF's rule, space included: a template that already ends turns with EOS gets no second one.
    text = text.rstrip("\n")
    return text if text.endswith(eos_token) else f"{text} {eos_token}"


# ---------------------------------------------------------------------------------------------------------------
# Tokenization


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _cut(ids: list[int], max_len: int, eos_id: int) -> tuple[list[int], bool]:
    """The first max_len ids with EOS as the last one (OpenRLHF overwrites it even when nothing was cut)."""
    kept = ids[:max_len]
    if kept:
        kept[-1] = eos_id
    return kept, len(ids) > max_len


def _common_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


# ---------------------------------------------------------------------------------------------------------------
# Loading


def _records(path: str, max_samples: int, max_len: int) -> list[Mapping[str, Any]]:
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
            raise DataError(f"{_where(path, index)} is {_shown(row)}; each record must be an object (key -> value).")
    return rows


def _check_tokenizer(tokenizer: PreTrainedTokenizerBase, apply_chat_template: bool, needs_eos: bool) -> None:
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


def _all_dropped(path: str, total: int, reasons: Counter[str], max_len: int) -> DataError:
    listed = ", ".join(f"{count} {reason}" for reason, count in reasons.most_common())
    return DataError(
        f"Every one of the {total} records of {path!r} was dropped ({listed}); nothing is left to train on. "
        f"Raise --max_len (now {max_len}) if prompts are too long, or check the keys and values of the records."
    )


def _finish(path: str, total: int, samples: list[T], reasons: Counter[str], truncated: int, max_len: int) -> Loaded[T]:
    if not samples:
        raise _all_dropped(path, total, reasons, max_len)
    return Loaded(samples=samples, dropped=sum(reasons.values()), truncated=truncated)


@dataclass(frozen=True)
class _Texts:
    prompt: str
    response: str


def _sft_texts(
    row: Mapping[str, Any],
    where: str,
    tokenizer: PreTrainedTokenizerBase,
    input_key: str,
    output_key: str | None,
    input_template: str | None,
    apply_chat_template: bool,
) -> _Texts:
    value = _field(row, input_key, "input_key", where)
    if apply_chat_template:
        if output_key is None:
            # The whole conversation in one field; the answer is its last message.
            messages = _messages(value, input_key, where, text_role=None)
            prompt, response = _chat_pair(tokenizer, messages[:-1], messages[-1:], where, "conversation")
        else:
            answer = _messages(_field(row, output_key, "output_key", where), output_key, where, "assistant")
            prompt, response = _chat_pair(
                tokenizer, _messages(value, input_key, where, "user"), answer, where, "prompt + response"
            )
        return _Texts(prompt, response)
    prompt = format_prompt(_string(value, input_key, where), tokenizer, input_template, apply_chat_template=False)
    response = "" if output_key is None else _string(_field(row, output_key, "output_key", where), output_key, where)
    return _Texts(prompt, response)


def _pretrain_samples(
    path: str, rows: list[Mapping[str, Any]], tokenizer: PreTrainedTokenizerBase, input_key: str, max_len: int
) -> Loaded[Completion]:
    """OpenRLHF pretrain_mode: the input_key text as is, cut to max_len; no template, no EOS, nothing masked."""
    texts = []
    for index, row in enumerate(rows):
        where = _where(path, index)
        texts.append(_string(_field(row, input_key, "input_key", where), input_key, where))
    reasons: Counter[str] = Counter()
    samples: list[Completion] = []
    truncated = 0
    for ids in _encode(tokenizer, texts):
        if not ids:
            reasons["with empty text"] += 1  # OpenRLHF would keep a zero-length row
            continue
        truncated += len(ids) > max_len
        samples.append(Completion(prompt=[], response=ids[:max_len]))
    return _finish(path, len(rows), samples, reasons, truncated, max_len)


def load_completions(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    input_key: str,
    output_key: str | None,
    input_template: str | None,
    apply_chat_template: bool,
    pretrain_mode: bool,
    max_len: int,
    max_samples: int,
) -> Loaded[Completion]:
    """SFT samples from the first max_samples records of `path`, as OpenRLHF's SFTDataset (single-turn).

    pretrain_mode trains on the input_key text alone (output_key, templates and EOS are not used, as in
    OpenRLHF); its Completion.prompt is empty and the first response id has no prediction.
    """
    rows = _records(path, max_samples, max_len)
    _check_tokenizer(tokenizer, apply_chat_template and not pretrain_mode, needs_eos=not pretrain_mode)
    if pretrain_mode:
        return _pretrain_samples(path, rows, tokenizer, input_key, max_len)
    if output_key is None and not apply_chat_template:
        raise DataError(
            "--output_key is unset and --apply_chat_template is off, so every record's response would be empty "
            "(OpenRLHF drops them all). Set --output_key to the response field, or pass --apply_chat_template with "
            "whole conversations in --input_key, or --pretrain_mode to train on the --input_key text."
        )
    reasons: Counter[str] = Counter()
    kept: list[_Texts] = []
    for index, row in enumerate(rows):
        texts_of_row = _sft_texts(
            row, _where(path, index), tokenizer, input_key, output_key, input_template, apply_chat_template
        )
        if not texts_of_row.prompt:
            reasons["with an empty prompt"] += 1
        elif not texts_of_row.response:
            reasons["with an empty response"] += 1
        else:
            kept.append(texts_of_row)
    eos_token, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    prompt_ids = _encode(tokenizer, [t.prompt for t in kept])
    full_ids = _encode(tokenizer, [_eos_terminated(t.prompt + t.response, eos_token) for t in kept])
    samples: list[Completion] = []
    truncated = 0
    for prompt, full in zip(prompt_ids, full_ids, strict=True):
        prompt_len = min(len(prompt), max_len)
        if prompt_len >= max_len - 2:  # OpenRLHF leaves at least 2 tokens for the answer
            reasons[f"with a prompt of >= max_len - 2 = {max_len - 2} tokens"] += 1
            continue
        ids, was_cut = _cut(full, max_len, eos_id)
        truncated += was_cut
        # Keep at least the EOS as response; only a tokenizer whose whole text is shorter than its prompt needs it.
        split = min(prompt_len, len(ids) - 1)
        samples.append(Completion(prompt=ids[:split], response=ids[split:]))
    return _finish(path, len(rows), samples, reasons, truncated, max_len)


@dataclass(frozen=True)
class _PairTexts:
    prompt: str
    chosen: str
    rejected: str
    margin: float


def _pair_texts(
    row: Mapping[str, Any],
    where: str,
    tokenizer: PreTrainedTokenizerBase,
    prompt_key: str | None,
    chosen_key: str,
    rejected_key: str,
    input_template: str | None,
    apply_chat_template: bool,
    task: PairTask,
) -> _PairTexts:
    chosen_value = _field(row, chosen_key, "chosen_key", where)
    rejected_value = _field(row, rejected_key, "rejected_key", where)
    margin = _margin(row, where) if task == "reward_model" else 0.0
    if not apply_chat_template:
        prompt = ""
        if prompt_key is not None:
            text = _string(_field(row, prompt_key, "prompt_key", where), prompt_key, where)
            prompt = format_prompt(text, tokenizer, input_template, apply_chat_template=False)
        chosen = _string(chosen_value, chosen_key, where)
        return _PairTexts(prompt, chosen, _string(rejected_value, rejected_key, where), margin)
    chosen_messages = _messages(chosen_value, chosen_key, where, "assistant")
    rejected_messages = _messages(rejected_value, rejected_key, where, "assistant")
    if prompt_key is not None:
        prompt_messages = _messages(_field(row, prompt_key, "prompt_key", where), prompt_key, where, "user")
        prompt, chosen = _chat_pair(tokenizer, prompt_messages, chosen_messages, where, "prompt + chosen")
        rejected = _after(
            _render(tokenizer, prompt_messages + rejected_messages, False, where), prompt, where, "prompt + rejected"
        )
        return _PairTexts(prompt, chosen, rejected, margin)
    chosen_full = _render(tokenizer, chosen_messages, False, where)
    rejected_full = _render(tokenizer, rejected_messages, False, where)
    if task == "reward_model":
        return _PairTexts("", chosen_full, rejected_full, margin)
    # DPO: the prompt is the chosen conversation before its last message, shared with the rejected one.
    prompt = _render(tokenizer, chosen_messages[:-1], True, where)
    return _PairTexts(
        prompt,
        _after(chosen_full, prompt, where, "chosen conversation"),
        _after(rejected_full, prompt, where, "rejected conversation"),
        margin,
    )


def load_preferences(
    path: str,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str | None,
    chosen_key: str,
    rejected_key: str,
    input_template: str | None,
    apply_chat_template: bool,
    max_len: int,
    max_samples: int,
    task: PairTask = "dpo",
) -> Loaded[Preference]:
    """Preference pairs from the first max_samples records of `path`, as OpenRLHF's RewardDataset.

    task="dpo" (train_dpo, is_dpo=True) drops records whose prompt is >= max_len - 2 tokens;
    task="reward_model" (train_rm) drops nothing and reads each record's optional "margin".
    Each of prompt + chosen and prompt + rejected is cut to max_len with EOS last.
    """
    rows = _records(path, max_samples, max_len)
    _check_tokenizer(tokenizer, apply_chat_template, needs_eos=True)
    pairs = [
        _pair_texts(
            row, _where(path, index), tokenizer, prompt_key, chosen_key, rejected_key,
            input_template, apply_chat_template, task,
        )
        for index, row in enumerate(rows)
    ]
    eos_token, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    prompt_ids = _encode(tokenizer, [pair.prompt for pair in pairs])
    chosen_ids = _encode(tokenizer, [_eos_terminated(pair.prompt + pair.chosen, eos_token) for pair in pairs])
    rejected_ids = _encode(tokenizer, [_eos_terminated(pair.prompt + pair.rejected, eos_token) for pair in pairs])
    reasons: Counter[str] = Counter()
    samples: list[Preference] = []
    truncated = 0
    for pair, prompt, chosen_full, rejected_full in zip(pairs, prompt_ids, chosen_ids, rejected_ids, strict=True):
        prompt_len = min(len(prompt), max_len)
        if task == "dpo" and prompt_len >= max_len - 2:
            reasons[f"with a prompt of >= max_len - 2 = {max_len - 2} tokens"] += 1
            continue
        chosen, chosen_cut = _cut(chosen_full, max_len, eos_id)
        rejected, rejected_cut = _cut(rejected_full, max_len, eos_id)
        truncated += chosen_cut or rejected_cut
        # One prompt serves both answers: where a tokenizer merges the prompt's last token differently
        # with each answer, the prompt stops where the two id lists part (both inputs stay exact), and
        # each answer keeps at least its EOS.
        split = min(prompt_len, _common_prefix(chosen, rejected), len(chosen) - 1, len(rejected) - 1)
        samples.append(Preference(prompt=chosen[:split], chosen=chosen[split:], rejected=rejected[split:],
                                  margin=pair.margin))
    return _finish(path, len(rows), samples, reasons, truncated, max_len)
