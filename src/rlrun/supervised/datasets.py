"""SFT and preference-pair records -> token ids, with OpenRLHF 0.11.2's text assembly, filtering and truncation.

The text of a sample is built as OpenRLHF's SFTDataset / RewardDataset build it:

- plain text: the prompt is `input_template.format(record[input_key])` (or the record's prompt as is); the
  sample text is `(prompt + response).rstrip("\n")`, then `" " + eos_token` unless it already ends with EOS;
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

import dataclasses
import json
import os
import random
import string
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

from rlrun.data import sources as fields
from rlrun.data.prompts import format_prompt
from rlrun.data.sources import DataSpec, read_sources, render, shown, where
from rlrun.models.tiny import BUILTIN_PROMPTS
from rlrun.rewards.demo import TARGET_CHARS
from rlrun.runtime.errors import DataError

# ---- records -----------------------------------------------------------------------------------------------------
# Record-level helpers of the SFT and preference loaders (rlrun.supervised.datasets): cutting a rendered
# conversation into prompt and answer, OpenRLHF 0.11.2's EOS and truncation rules, and the accounting of dropped
# records. Field access and chat rendering shared with PPO's prompts live in rlrun.data.sources.

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


def read_margin(row: Mapping[str, Any], where: str) -> float:
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
            f"{full[:160]!r}; the answer cannot be cut out of it. The conversation must end with the assistant's "
            f"answer, "
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
        raise DataError(f"Dataset {str(path)!r} is empty; it needs at least one record.")
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


def all_dropped(path: str | DataSpec, total: int, reasons: Counter[str], max_len: int) -> DataError:
    listed = ", ".join(f"{count} {reason}" for reason, count in reasons.most_common())
    return DataError(
        f"Every one of the {total} records of {str(path)!r} was dropped ({listed}); nothing is left to train on. "
        f"Raise --max_len (now {max_len}) if prompts are too long, or check the keys and values of the records."
    )


def finish(
    path: str | DataSpec, total: int, samples: list[T], reasons: Counter[str], truncated: int, max_len: int
) -> Loaded[T]:
    if not samples:
        raise all_dropped(path, total, reasons, max_len)
    return Loaded(samples=samples, dropped=sum(reasons.values()), truncated=truncated)


if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PairTask = Literal["reward_model", "dpo"]
"""Which OpenRLHF trainer's pair semantics: DPO drops long prompts and splits chat pairs at their shared prompt."""


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
    value = fields.field(row, input_key, "input_key", where)
    if apply_chat_template:
        if output_key is None:
            # The whole conversation in one field; the answer is its last message.
            messages = fields.messages(value, input_key, where, text_role=None)
            prompt, response = chat_pair(tokenizer, messages[:-1], messages[-1:], where, "conversation")
        else:
            answer = fields.messages(fields.field(row, output_key, "output_key", where), output_key, where, "assistant")
            prompt, response = chat_pair(
                tokenizer, fields.messages(value, input_key, where, "user"), answer, where, "prompt + response"
            )
        return _Texts(prompt, response)
    prompt = format_prompt(fields.string(value, input_key, where), tokenizer, input_template, apply_chat_template=False)
    response = (
        ""
        if output_key is None
        else fields.string(fields.field(row, output_key, "output_key", where), output_key, where)
    )
    return _Texts(prompt, response)


def _pretrain_samples(
    path: str | DataSpec,
    rows: list[Mapping[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    input_key: str,
    max_len: int,
) -> Loaded[Completion]:
    """OpenRLHF pretrain_mode: the input_key text as is, cut to max_len; no template, no EOS, nothing masked."""
    texts = []
    for index, row in enumerate(rows):
        where = fields.where(path, index)
        texts.append(fields.string(fields.field(row, input_key, "input_key", where), input_key, where))
    reasons: Counter[str] = Counter()
    samples: list[Completion] = []
    truncated = 0
    for ids in encode(tokenizer, texts):
        if not ids:
            reasons["with empty text"] += 1  # OpenRLHF would keep a zero-length row
            continue
        truncated += len(ids) > max_len
        samples.append(Completion(prompt=[], response=ids[:max_len]))
    return finish(path, len(rows), samples, reasons, truncated, max_len)


def load_completions(
    path: str | DataSpec,
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
    rows = records(path, max_samples, max_len)
    check_tokenizer(tokenizer, apply_chat_template and not pretrain_mode, needs_eos=not pretrain_mode)
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
            row, fields.where(path, index), tokenizer, input_key, output_key, input_template, apply_chat_template
        )
        if not texts_of_row.prompt:
            reasons["with an empty prompt"] += 1
        elif not texts_of_row.response:
            reasons["with an empty response"] += 1
        else:
            kept.append(texts_of_row)
    eos_token, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    prompt_ids = encode(tokenizer, [t.prompt for t in kept])
    full_ids = encode(tokenizer, [eos_terminated(t.prompt + t.response, eos_token) for t in kept])
    samples: list[Completion] = []
    truncated = 0
    for prompt, full in zip(prompt_ids, full_ids, strict=True):
        prompt_len = min(len(prompt), max_len)
        if prompt_len >= max_len - 2:  # OpenRLHF leaves at least 2 tokens for the answer
            reasons[f"with a prompt of >= max_len - 2 = {max_len - 2} tokens"] += 1
            continue
        ids, was_cut = cut(full, max_len, eos_id)
        truncated += was_cut
        # Keep at least the EOS as response; only a tokenizer whose whole text is shorter than its prompt needs it.
        split = min(prompt_len, len(ids) - 1)
        samples.append(Completion(prompt=ids[:split], response=ids[split:]))
    return finish(path, len(rows), samples, reasons, truncated, max_len)


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
    chosen_value = fields.field(row, chosen_key, "chosen_key", where)
    rejected_value = fields.field(row, rejected_key, "rejected_key", where)
    margin = read_margin(row, where) if task == "reward_model" else 0.0
    if not apply_chat_template:
        prompt = ""
        if prompt_key is not None:
            text = fields.string(fields.field(row, prompt_key, "prompt_key", where), prompt_key, where)
            prompt = format_prompt(text, tokenizer, input_template, apply_chat_template=False)
        chosen = fields.string(chosen_value, chosen_key, where)
        return _PairTexts(prompt, chosen, fields.string(rejected_value, rejected_key, where), margin)
    chosen_messages = fields.messages(chosen_value, chosen_key, where, "assistant")
    rejected_messages = fields.messages(rejected_value, rejected_key, where, "assistant")
    if prompt_key is not None:
        prompt_messages = fields.messages(fields.field(row, prompt_key, "prompt_key", where), prompt_key, where, "user")
        prompt, chosen = chat_pair(tokenizer, prompt_messages, chosen_messages, where, "prompt + chosen")
        rejected = after(
            fields.render(tokenizer, prompt_messages + rejected_messages, False, where),
            prompt,
            where,
            "prompt + rejected",
        )
        return _PairTexts(prompt, chosen, rejected, margin)
    chosen_full = fields.render(tokenizer, chosen_messages, False, where)
    rejected_full = fields.render(tokenizer, rejected_messages, False, where)
    if task == "reward_model":
        return _PairTexts("", chosen_full, rejected_full, margin)
    # DPO: the prompt is the chosen conversation before its last message, shared with the rejected one.
    prompt = fields.render(tokenizer, chosen_messages[:-1], True, where)
    return _PairTexts(
        prompt,
        after(chosen_full, prompt, where, "chosen conversation"),
        after(rejected_full, prompt, where, "rejected conversation"),
        margin,
    )


def load_preferences(
    path: str | DataSpec,
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
    rows = records(path, max_samples, max_len)
    check_tokenizer(tokenizer, apply_chat_template, needs_eos=True)
    pairs = [
        _pair_texts(
            row,
            fields.where(path, index),
            tokenizer,
            prompt_key,
            chosen_key,
            rejected_key,
            input_template,
            apply_chat_template,
            task,
        )
        for index, row in enumerate(rows)
    ]
    eos_token, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    prompt_ids = encode(tokenizer, [pair.prompt for pair in pairs])
    chosen_ids = encode(tokenizer, [eos_terminated(pair.prompt + pair.chosen, eos_token) for pair in pairs])
    rejected_ids = encode(tokenizer, [eos_terminated(pair.prompt + pair.rejected, eos_token) for pair in pairs])
    reasons: Counter[str] = Counter()
    samples: list[Preference] = []
    truncated = 0
    for pair, prompt, chosen_full, rejected_full in zip(pairs, prompt_ids, chosen_ids, rejected_ids, strict=True):
        prompt_len = min(len(prompt), max_len)
        if task == "dpo" and prompt_len >= max_len - 2:
            reasons[f"with a prompt of >= max_len - 2 = {max_len - 2} tokens"] += 1
            continue
        chosen, chosen_cut = cut(chosen_full, max_len, eos_id)
        rejected, rejected_cut = cut(rejected_full, max_len, eos_id)
        truncated += chosen_cut or rejected_cut
        # One prompt serves both answers: where a tokenizer merges the prompt's last token differently
        # with each answer, the prompt stops where the two id lists part (both inputs stay exact), and
        # each answer keeps at least its EOS.
        split = min(prompt_len, common_prefix(chosen, rejected), len(chosen) - 1, len(rejected) - 1)
        samples.append(
            Preference(prompt=chosen[:split], chosen=chosen[split:], rejected=rejected[split:], margin=pair.margin)
        )
    return finish(path, len(rows), samples, reasons, truncated, max_len)


# ---- the demo data -----------------------------------------------------------------------------------------------
# Generated data for the offline pipeline on the embedded tiny model (SFT -> RM -> PPO, and DPO): the built-in
# demo task (rlrun.models.tiny.BUILTIN_PROMPTS: answer with digits, or with lowercase letters) as SFT records and
# preference pairs whose chosen answer keeps to the asked characters and whose rejected answer does not.
#
#     python -m rlrun.supervised.datasets OUT_DIR   # writes sft.jsonl, pairs.jsonl, pairs_eval.jsonl

# Characters of the wrong kind for each label: uppercase letters and punctuation, and the other label's set.
_OFF_TARGET = {
    label: "".join(sorted(set(string.ascii_uppercase + string.punctuation + "".join(other))))
    for label in TARGET_CHARS
    for other_label, other in TARGET_CHARS.items()
    if other_label != label
}


def _answer(rng: random.Random, chars: str, low: int = 6, high: int = 14) -> str:
    return "".join(rng.choice(chars) for _ in range(rng.randint(low, high)))


def sft_records(count: int, seed: int) -> list[dict[str, str]]:
    """{"input": prompt, "output": an answer of the asked kind}."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        p = BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)]
        records.append({"input": p["prompt"], "output": _answer(rng, "".join(sorted(TARGET_CHARS[p["label"]])))})
    return records


def pair_records(count: int, seed: int) -> list[dict[str, str]]:
    """{"prompt", "chosen": the asked kind, "rejected": half of its characters of the wrong kind}."""
    rng = random.Random(seed)
    records = []
    for i in range(count):
        p = BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)]
        good = "".join(sorted(TARGET_CHARS[p["label"]]))
        chosen = _answer(rng, good)
        rejected = "".join(c if rng.random() < 0.5 else rng.choice(_OFF_TARGET[p["label"]]) for c in _answer(rng, good))
        records.append({"prompt": p["prompt"], "chosen": chosen, "rejected": rejected})
    return records


def _write(path: str, records: list[dict[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")


def write_all(out_dir: str, *, sft: int = 256, pairs: int = 256, eval_pairs: int = 64, seed: int = 0) -> dict[str, str]:
    """Write the three files; returns their paths by name."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, f"{name}.jsonl") for name in ("sft", "pairs", "pairs_eval")}
    _write(paths["sft"], sft_records(sft, seed))
    _write(paths["pairs"], pair_records(pairs, seed + 1))
    _write(paths["pairs_eval"], pair_records(eval_pairs, seed + 2))
    return paths


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m rlrun.supervised.datasets OUT_DIR")
    for name, path in write_all(sys.argv[1]).items():
        print(f"{name}: {path}")
