"""Where records come from, as OpenRLHF's `blending_datasets` reads `--prompt_data`/`--dataset`: a comma-separated
list of sources, each a data file, a directory (written by `save_to_disk`, or holding data files) or a Hugging Face
Hub dataset id, optionally `SOURCE@DATA_DIR` (a sub-folder of a directory or repo); the `--prompt_split` split of
each; at most `--max_samples` records of each; then concatenated, or with `--prompt_data_probs` interleaved by
datasets' `interleave_datasets` (seeded, "all_exhausted"), as OpenRLHF does.

A directory or repo of data files is split by the hub's file-name convention: a file belongs to split S when S is
its stem, a path component, or the stem's prefix before '-' or '_' (`data/train-00000-of-00002.parquet`,
`test.jsonl`, `train/part_0.json`); with no file named after any split, every file is the 'train' split.
"""

from __future__ import annotations

import csv
import difflib
import io
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlrun.models.hub import RepoType, cached, missing_note, parse_repo_id, resolve
from rlrun.runtime.errors import DataError, MissingExtraError

# ---- files -------------------------------------------------------------------------------------------------------
# Data files as records: .jsonl/.json/.parquet/.csv files and `save_to_disk` directories (one split), with errors
# that name the file, the line or record, and the fix.

FILE_FORMATS: tuple[str, ...] = (".jsonl", ".json", ".parquet", ".csv")


def _read_text(path: str) -> str:
    """The file as UTF-8 text, or a DataError naming the first byte that is not UTF-8 and its line."""
    with open(path, "rb") as handle:
        raw = handle.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise DataError(
            f"{path}: line {line} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            "save the file as UTF-8"
        ) from None


def _read_jsonl(path: str) -> list[Any]:
    rows: list[Any] = []
    for line_number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue  # trailing/blank lines are common in hand-written files
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            # Records count from 0 in every message (as indexes do); lines count from 1 (as editors do).
            raise DataError(
                f"{path}: record {len(rows)} (line {line_number}) is not valid JSON ({exc}); each line "
                "must be one JSON object."
            ) from None
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
        import pyarrow.parquet as pq  # noqa: PLC0415 - optional extra (rlrun[data])
    except ImportError as exc:
        raise MissingExtraError("pyarrow", "data", "Loading a .parquet prompt file") from exc
    return pq.read_table(path).to_pylist()


def _read_csv(path: str) -> list[Any]:
    # The stdlib reader is enough for prompt files and needs no optional dependency.
    return list(csv.DictReader(io.StringIO(_read_text(path), newline="")))


def _read_saved_dataset(path: str, split: str = "train") -> list[Any]:
    try:
        import datasets  # noqa: PLC0415 - optional extra (rlrun[data])
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
            raise DataError(
                f"{path} is a DatasetDict without a {split!r} split (splits: {sorted(loaded)}); choose "
                "one with --prompt_split / --eval_split (rlrun.sft/rm/dpo: --dataset_split)."
            )
        loaded = loaded[split]
    return loaded.to_list()


def read_rows(path: str, split: str = "train") -> list[Any]:
    """The records of a .jsonl/.json/.parquet/.csv file or a save_to_disk directory (its `split`). Several
    sources, data-file folders and hub ids: rlrun.data.sources."""
    if not os.path.exists(path):
        raise DataError(
            f"{path!r} does not exist; check the path (a Hugging Face Hub dataset id has the form "
            "owner/name; an unset --prompt_data/--dataset uses the built-in data)"
        )
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


# ---- reading a field ---------------------------------------------------------------------------------------------
# Reading one field of one record the way users' datasets hold it, and rendering chat messages.
#
# Shared by PPO's prompts (rlrun.data.prompts) and the SFT/RM/DPO loaders (rlrun.supervised.datasets):
# - a key may be a dotted path into nested fields (`reward_model.ground_truth`, verl's and Search-R1's label), tried
#   after the literal key so a column named `a.b` still wins;
# - a chat is a list of `{"role", "content"}` messages, as OpenRLHF's `context_messages`, verl's `prompt` column
#   (parquet's nested arrays arrive as lists of dicts) or JSON text of the same;
# - every error names the file, the record (counted from 0) and the key.

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Messages = list[dict[str, Any]]
MISSING = object()  # lookup() of a key a record lacks


def where(path: str | DataSpec, index: int) -> str:
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
        raise DataError(
            f"{where} has no {flag} {key!r}{nested}; keys present: {present}.{hint} Set --{flag} to one of "
            "them (a dotted path reaches nested fields)."
        )
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


def render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Messages,
    generation_prompt: bool,
    where: str,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """`messages` through the tokenizer's chat template as text (verl's data.apply_chat_template_kwargs, e.g.
    `enable_thinking`, go to the template)."""
    from jinja2 import TemplateError  # noqa: PLC0415 - transformers' dependency, needed only with a chat template

    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **dict(template_kwargs or {})
        )
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


KNOWN_SPLITS = ("train", "test", "validation", "valid", "dev", "eval")


@dataclass(frozen=True)
class DataSpec:
    """One data flag's sources as the user gave them, with how to read and blend them."""

    sources: str
    flag: str = "prompt_data"
    split: str = "train"
    probs: str | None = None  # comma-separated, one per source: interleave instead of concatenating
    seed: int = 42
    max_count: int | None = None  # records kept per source

    def __str__(self) -> str:  # messages name the sources as the user gave them
        return self.sources

    def names(self) -> list[str]:
        names = [s.strip() for s in self.sources.split(",")]
        if not all(names):
            raise DataError(f"--{self.flag} {self.sources!r} has an empty entry; separate sources with single commas")
        return names

    def weights(self) -> list[float] | None:
        if self.probs is None:
            return None
        try:
            weights = [float(p) for p in self.probs.split(",")]
        except ValueError:
            raise DataError(f"--{self.flag}_probs {self.probs!r} must be comma-separated numbers") from None
        # A zero weight never draws from its source, which then never runs out: "all_exhausted" would not end.
        if len(weights) != len(self.names()) or not all(w > 0 for w in weights):
            raise DataError(
                f"--{self.flag}_probs {self.probs!r} needs one positive weight per source of --{self.flag} "
                f"({len(self.names())}: {self.sources}); drop a source rather than weighting it 0"
            )
        return weights


def _split_of(relative: Path, split: str) -> bool:
    parts = [p.lower() for p in relative.parts[:-1]]
    stem = relative.name.split(".")[0].lower()
    head = stem.replace("_", "-").split("-")[0]
    return split.lower() in (*parts, stem, head)


def _data_files(folder: str, split: str, shown: str) -> list[str]:
    root = Path(folder)
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file()
        and p.suffix.lower() in FILE_FORMATS
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    if not files:
        raise DataError(f"{shown} holds no data files ({', '.join(FILE_FORMATS)}) and was not written by save_to_disk")
    named = [p for p in files if any(_split_of(p.relative_to(root), s) for s in (*KNOWN_SPLITS, split))]
    chosen = [p for p in files if _split_of(p.relative_to(root), split)]
    if not named and split == "train":
        chosen = files
    if not chosen:
        raise DataError(
            f"{shown} has no '{split}' split; its data files: "
            f"{', '.join(str(p.relative_to(root)) for p in files[:8])}. Choose the split (--prompt_split / "
            "--eval_split) or a SOURCE@DATA_DIR"
        )
    return [str(p) for p in chosen]


def _is_saved_dataset(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, f)) for f in ("dataset_dict.json", "state.json"))


def _read_source(name: str, spec: DataSpec) -> list[Any]:
    source, _, data_dir = name.partition("@") if not os.path.exists(name) else (name, "", "")
    if not os.path.exists(source) and parse_repo_id(source) is None:
        raise DataError(
            f"--{spec.flag} {source}: no such file or directory (the path does not exist); check it (a "
            "Hugging Face Hub dataset id has the form owner/name)"
        )
    if os.path.isfile(source):
        return read_rows(source)
    folder = resolve(source, "dataset", spec.flag)
    shown = f"--{spec.flag} {name}" + ("" if folder == source else f" ({folder})")
    if data_dir:
        folder = os.path.join(folder, data_dir.strip())
        if not os.path.isdir(folder):
            raise DataError(f"{shown}: no folder {data_dir!r} in it")
    if _is_saved_dataset(folder):
        return read_rows(folder, split=spec.split)
    rows: list[Any] = []
    for path in _data_files(folder, spec.split, shown):
        rows.extend(read_rows(path))
    return rows


def _interleave(parts: list[list[Any]], weights: list[float], seed: int) -> list[Any]:
    try:
        import datasets  # noqa: PLC0415 - optional extra (rlrun[data])
    except ImportError as exc:
        raise MissingExtraError("datasets", "data", "Blending datasets by probability (--prompt_data_probs)") from exc
    total = sum(weights)
    mixed = datasets.interleave_datasets(
        [datasets.Dataset.from_list(p) for p in parts],
        probabilities=[w / total for w in weights],
        seed=seed,
        stopping_strategy="all_exhausted",
    )
    return mixed.to_list()


def not_here(sources: str) -> list[str]:
    """The entries of a comma-separated source list that are neither a path here nor a hub dataset in this machine's
    hub cache (another machine's paths, an earlier stage's output, a dataset downloaded at start-up): a dry run on a
    login node names them instead of failing or downloading."""
    names = [n.strip() for n in sources.split(",")]
    return [
        n
        for n in names
        if not os.path.exists(n)
        and not os.path.exists(n.partition("@")[0])
        and cached(n.partition("@")[0], "dataset") is None
    ]


def missing_paths(models: Sequence[tuple[str, str | None]], data: Sequence[tuple[str, str | None]]) -> list[str]:
    """A dry run's warning per value this machine cannot read: (flag, path or hub id) of model flags, (flag, source
    list) of data flags (each source without its @DATA_DIR); unset flags are skipped."""
    named: list[tuple[str, str, RepoType]] = [(flag, path, "model") for flag, path in models if path is not None]
    named += [
        (flag, n.strip().partition("@")[0], "dataset")
        for flag, sources in data
        for n in (sources or "").split(",")
        if n.strip()
    ]
    return [note for flag, name, kind in named if (note := missing_note(flag, name, kind)) is not None]


def read_sources(spec: DataSpec) -> list[Any]:
    """The records of every source of `spec`, blended as OpenRLHF does."""
    names = spec.names()
    weights = spec.weights()
    parts = []
    for name in names:
        rows = _read_source(name, spec)
        parts.append(rows if spec.max_count is None else rows[: spec.max_count])
    if weights is None or len(parts) == 1:
        return [row for part in parts for row in part]
    empty = [n for n, p in zip(names, parts) if not p]
    if empty:
        raise DataError(f"--{spec.flag}: {', '.join(empty)} has no records; it cannot be blended")
    return _interleave(parts, weights, spec.seed)
