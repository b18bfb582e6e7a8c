"""Data files as records: .jsonl/.json/.parquet/.csv files and `save_to_disk` directories (one split), with errors
that name the file, the line or record, and the fix."""

from __future__ import annotations

import csv
import io
import json
import os
from typing import Any

from rlrun.runtime.errors import DataError, MissingExtraError

FILE_FORMATS: tuple[str, ...] = (".jsonl", ".json", ".parquet", ".csv")


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


def _read_saved_dataset(path: str, split: str = "train") -> list[Any]:
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
        if split not in loaded:
            raise DataError(f"{path} is a DatasetDict without a {split!r} split (splits: {sorted(loaded)}); choose "
                            "one with --prompt_split / --eval_split (rlrun.sft/rm/dpo: --dataset_split).")
        loaded = loaded[split]
    return loaded.to_list()


def read_rows(path: str, split: str = "train") -> list[Any]:
    """The records of a .jsonl/.json/.parquet/.csv file or a save_to_disk directory (its `split`). Several
    sources, data-file folders and hub ids: rlrun.data.sources."""
    if not os.path.exists(path):
        raise DataError(f"{path!r} does not exist; check the path (a Hugging Face Hub dataset id has the form "
                        "owner/name; an unset --prompt_data/--dataset uses the built-in data)")
    if os.path.isdir(path):
        return _read_saved_dataset(path, split)
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet, ".csv": _read_csv}
    extension = os.path.splitext(path)[1].lower()
    if extension not in readers:
        raise DataError(
            f"Prompt file {path!r} has unsupported extension {extension!r}; use one of {list(FILE_FORMATS)} "
            "or a directory written by datasets' save_to_disk."
        )
    return readers[extension](path)
