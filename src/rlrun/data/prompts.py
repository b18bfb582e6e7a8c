"""Prompt data: loading records, formatting prompts, deterministic order, tokenization."""

from __future__ import annotations

import csv
import io
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rlrun.data import records
from rlrun.data.records import Messages
from rlrun.runtime.errors import DataError, MissingExtraError

FILE_FORMATS: tuple[str, ...] = (".jsonl", ".json", ".parquet", ".csv")


@dataclass(frozen=True)
class PromptRecord:
    """One prompt as its dataset holds it: text or a chat (rendered later, with the tokenizer), and what the
    reward receives about it."""

    prompt: str | Messages
    label: Any = None  # plain Python (a str, a number, {"target": [...]}, ...); None without --label_key
    data_source: str | None = None  # verl's reward_fn_key field: picks the rule scorer
    extra_info: dict[str, Any] | None = None  # verl's extra_info column, for compute_score


def _read_text(path: str) -> str:
    """The file as UTF-8 text, or a DataError naming the first byte that is not UTF-8 and its line."""
    with open(path, "rb") as handle:
        raw = handle.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{path}: line {line} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                        "save the file as UTF-8") from None


def _read_jsonl(path: str) -> list[Any]:
    rows: list[Any] = []
    for line_number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue  # trailing/blank lines are common in hand-written files
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            # Records count from 0 in every message (as indexes do); lines count from 1 (as editors do).
            raise DataError(f"{path}: record {len(rows)} (line {line_number}) is not valid JSON ({exc}); each line "
                            "must be one JSON object.") from None
    return rows


def _read_json(path: str) -> list[Any]:
    try:
        rows = json.loads(_read_text(path))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path} is not valid JSON ({exc}).") from None
    if not isinstance(rows, list):
        raise DataError(
            f"{path} holds a JSON {type(rows).__name__}; a .json prompt file must be a list of objects "
            '(e.g. [{"prompt": "..."}]). Use .jsonl for one object per line.'
        )
    return rows


def _read_parquet(path: str) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise MissingExtraError("pyarrow", "data", "Loading a .parquet prompt file") from exc
    return pq.read_table(path).to_pylist()


def _read_csv(path: str) -> list[Any]:
    # The stdlib reader is enough for prompt files and needs no optional dependency.
    return list(csv.DictReader(io.StringIO(_read_text(path), newline="")))


def _read_saved_dataset(path: str) -> list[Any]:
    try:
        import datasets
    except ImportError as exc:
        raise MissingExtraError("datasets", "data", "Loading a saved HF datasets directory") from exc
    try:
        loaded = datasets.load_from_disk(path)
    except FileNotFoundError as exc:
        raise DataError(
            f"{path} is a directory but not one written by datasets' save_to_disk ({exc}); "
            f"pass a directory from Dataset.save_to_disk or a file ending in one of {list(FILE_FORMATS)}."
        ) from exc
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(
                f"{path} is a DatasetDict without a 'train' split (splits: {sorted(loaded)}); "
                "save the prompts as the 'train' split."
            )
        loaded = loaded["train"]
    return loaded.to_list()


def read_rows(path: str) -> list[Any]:
    """The records of a .jsonl/.json/.parquet/.csv file or a save_to_disk directory (its 'train' split)."""
    if not os.path.exists(path):
        raise DataError(
            f"Prompt data path {path!r} does not exist; check the path, or pass no path to use the built-in prompts."
        )
    if os.path.isdir(path):
        return _read_saved_dataset(path)
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".csv": _read_csv}
    extension = os.path.splitext(path)[1].lower()
    if extension not in readers:
        raise DataError(
            f"Prompt file {path!r} has unsupported extension {extension!r}; use one of {list(FILE_FORMATS)} "
            "or a directory written by datasets' save_to_disk."
        )
    return readers[extension](path)


@dataclass(frozen=True)
class PromptKeys:
    """Where a record keeps what a prompt needs (OpenRLHF's --input_key/--label_key, verl's data.prompt_key,
    data.reward_fn_key); dotted paths reach nested fields."""

    input_key: str = "prompt"
    label_key: str | None = None
    data_source_key: str = "data_source"
    extra_info_key: str = "extra_info"


def _to_record(row: Any, index: int, path: str, keys: PromptKeys) -> PromptRecord:
    at = records.where(path, index)
    if not isinstance(row, Mapping):
        raise DataError(f"{at} is a {type(row).__name__} ({str(row)[:80]!r}); each record must be an object with an "
                        f"{keys.input_key!r} key.")
    value = records.parsed_messages(records.plain(records.field(row, keys.input_key, "input_key", at)))
    if isinstance(value, list) and value and records.looks_like_messages(value):
        prompt: str | Messages = records.messages(value, keys.input_key, at, text_role=None)
    elif isinstance(value, str):
        prompt = value
    else:
        raise DataError(f"{at} has {keys.input_key!r} = {records.shown(value)}; a prompt must be a string or a list "
                        'of {"role": ..., "content": ...} chat messages.')
    label = None if keys.label_key is None else records.plain(records.field(row, keys.label_key, "label_key", at))
    source = records.lookup(row, keys.data_source_key)
    extra = records.plain(records.lookup(row, keys.extra_info_key))
    return PromptRecord(prompt, label, source if isinstance(source, str) else None,
                        extra if isinstance(extra, dict) else None)


def load_prompt_records(path: str | None, keys: PromptKeys = PromptKeys(), max_samples: int | None = None
                        ) -> list[PromptRecord]:
    """Prompt records from a .jsonl/.json (a list of objects)/.parquet/.csv file or a save_to_disk dir.

    path=None gives rlrun.models.tiny.BUILTIN_PROMPTS, always read with keys "prompt" and "label".
    max_samples keeps the first N records.
    """
    if max_samples is not None and max_samples < 1:
        raise DataError(f"max_samples={max_samples} keeps no prompts; pass a positive number or None for all.")
    if path is None:
        from rlrun.models.tiny import BUILTIN_PROMPTS  # lazy: tiny imports transformers, which file loading never needs

        source, rows, keys = "<built-in prompts>", list(BUILTIN_PROMPTS), PromptKeys("prompt", "label")
    else:
        source, rows = path, read_rows(path)
    if not rows:
        raise DataError(f"Prompt data {source!r} is empty; it needs at least one record with key {keys.input_key!r}.")
    rows = rows[:max_samples]
    return [_to_record(row, index, source, keys) for index, row in enumerate(rows)]


def format_prompt(prompt: str | Messages, tokenizer: Any, input_template: str | None, apply_chat_template: bool,
                  template_kwargs: Mapping[str, Any] | None = None, where: str = "prompt") -> str:
    """The text the policy continues, as OpenRLHF's PromptDataset and verl's RLHFDataset build it: a chat (a message
    list, always; a string with --apply_chat_template, as one user turn) through the tokenizer's chat template
    with the generation prompt; otherwise the string through --input_template (`{}` is the prompt) or as it is."""
    if isinstance(prompt, list) or apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{where} is a chat (a message list, or --apply_chat_template) but the tokenizer has no "
                            "chat_template; use a model whose tokenizer has one, or pass plain-text prompts without "
                            "--apply_chat_template (--input_template formats them)")
        chat = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return records.render(tokenizer, chat, True, where, template_kwargs)
    if input_template is None:
        return prompt
    if "{}" not in input_template:
        raise DataError(
            f"input_template {input_template!r} has no '{{}}' placeholder for the prompt; add one, e.g. 'Q: {{}}\\nA:'."
        )
    try:
        return input_template.format(prompt)
    except (IndexError, KeyError, ValueError) as exc:
        raise DataError(
            f"input_template {input_template!r} cannot be formatted ({exc!r}); "
            "escape literal braces as '{{' and '}}'."
        ) from exc


class PromptSampler:
    """Deterministic prompt order: step -> record indices is a pure function, so resume needs only the step."""

    def __init__(self, num_records: int, rollout_batch_size: int, seed: int, num_episodes: int) -> None:
        if rollout_batch_size < 1 or num_episodes < 1:
            raise DataError(
                f"rollout_batch_size={rollout_batch_size} and num_episodes={num_episodes} must both be >= 1."
            )
        if num_records < rollout_batch_size:
            raise DataError(
                f"Only {num_records} prompt records for rollout_batch_size={rollout_batch_size}; "
                "add prompts or lower rollout_batch_size so one full batch fits."
            )
        self.num_records = num_records
        self.rollout_batch_size = rollout_batch_size
        self.seed = seed
        self.num_episodes = num_episodes
        # The last partial batch is dropped so every step sees rollout_batch_size prompts.
        self.steps_per_episode = num_records // rollout_batch_size
        self.total_steps = self.steps_per_episode * num_episodes
        self._cached: tuple[int, list[int]] | None = None

    def _episode_seed(self, episode: int) -> int:
        # Hashing (seed, episode) keeps nearby seeds from sharing permutations (seed+1 vs episode+1).
        digest = hashlib.sha256(f"rlrun-prompts:{self.seed}:{episode}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

    def permutation(self, episode: int) -> list[int]:
        """The record order of one episode; depends only on (seed, episode)."""
        if self._cached is None or self._cached[0] != episode:
            generator = torch.Generator().manual_seed(self._episode_seed(episode))
            self._cached = (episode, torch.randperm(self.num_records, generator=generator).tolist())
        return self._cached[1]

    def _check_step(self, step: int) -> None:
        if not 0 <= step < self.total_steps:
            raise DataError(
                f"step={step} is outside [0, {self.total_steps}) "
                f"({self.num_episodes} episodes x {self.steps_per_episode} steps); resume from a step of this run."
            )

    def episode_of(self, step: int) -> int:
        self._check_step(step)
        return step // self.steps_per_episode

    def indices(self, step: int) -> list[int]:
        """Record indices of global step `step` (0-based)."""
        episode = self.episode_of(step)
        start = (step % self.steps_per_episode) * self.rollout_batch_size
        return self.permutation(episode)[start : start + self.rollout_batch_size]


def tokenize_prompts(texts: list[str], tokenizer: Any, prompt_max_len: int) -> tuple[list[list[int]], int]:
    """Token ids without special tokens, and how many prompts were longer than prompt_max_len.

    Long prompts keep their LAST prompt_max_len tokens: the end holds the generation prompt
    (e.g. "Assistant: ") that the response must follow.
    """
    if prompt_max_len < 1:
        raise DataError(f"prompt_max_len={prompt_max_len} must be >= 1.")
    if not texts:
        return [], 0
    encoded: list[list[int]] = tokenizer(texts, add_special_tokens=False)["input_ids"]
    truncated = 0
    result: list[list[int]] = []
    for index, ids in enumerate(encoded):
        if not ids:
            raise DataError(
                f"Prompt {index} ({texts[index][:80]!r}) tokenizes to no tokens; generation needs a non-empty prompt."
            )
        if len(ids) > prompt_max_len:
            truncated += 1
            ids = ids[-prompt_max_len:]
        result.append(list(ids))
    return result, truncated
