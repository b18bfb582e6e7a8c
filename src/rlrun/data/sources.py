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

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rlrun.data.files import FILE_FORMATS, read_rows
from rlrun.models.hub import RepoType, cached, missing_note, parse_repo_id, resolve
from rlrun.runtime.errors import DataError, MissingExtraError

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
            raise DataError(f"--{self.flag}_probs {self.probs!r} needs one positive weight per source of --{self.flag} "
                            f"({len(self.names())}: {self.sources}); drop a source rather than weighting it 0")
        return weights


def _split_of(relative: Path, split: str) -> bool:
    parts = [p.lower() for p in relative.parts[:-1]]
    stem = relative.name.split(".")[0].lower()
    head = stem.replace("_", "-").split("-")[0]
    return split.lower() in (*parts, stem, head)


def _data_files(folder: str, split: str, shown: str) -> list[str]:
    root = Path(folder)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in FILE_FORMATS
                   and not any(part.startswith(".") for part in p.relative_to(root).parts))
    if not files:
        raise DataError(f"{shown} holds no data files ({', '.join(FILE_FORMATS)}) and was not written by save_to_disk")
    named = [p for p in files if any(_split_of(p.relative_to(root), s) for s in (*KNOWN_SPLITS, split))]
    chosen = [p for p in files if _split_of(p.relative_to(root), split)]
    if not named and split == "train":
        chosen = files
    if not chosen:
        raise DataError(f"{shown} has no '{split}' split; its data files: "
                        f"{', '.join(str(p.relative_to(root)) for p in files[:8])}. Choose the split (--prompt_split / "
                        "--eval_split) or a SOURCE@DATA_DIR")
    return [str(p) for p in chosen]


def _is_saved_dataset(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, f)) for f in ("dataset_dict.json", "state.json"))


def _read_source(name: str, spec: DataSpec) -> list[Any]:
    source, _, data_dir = name.partition("@") if not os.path.exists(name) else (name, "", "")
    if not os.path.exists(source) and parse_repo_id(source) is None:
        raise DataError(f"--{spec.flag} {source}: no such file or directory (the path does not exist); check it (a "
                        "Hugging Face Hub dataset id has the form owner/name)")
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
        import datasets
    except ImportError as exc:
        raise MissingExtraError("datasets", "data", "Blending datasets by probability (--prompt_data_probs)") from exc
    total = sum(weights)
    mixed = datasets.interleave_datasets([datasets.Dataset.from_list(p) for p in parts],
                                         probabilities=[w / total for w in weights], seed=seed,
                                         stopping_strategy="all_exhausted")
    return mixed.to_list()


def not_here(sources: str) -> list[str]:
    """The entries of a comma-separated source list that are neither a path here nor a hub dataset in this machine's
    hub cache (another machine's paths, an earlier stage's output, a dataset downloaded at start-up): a dry run on a
    login node names them instead of failing or downloading."""
    names = [n.strip() for n in sources.split(",")]
    return [n for n in names if not os.path.exists(n) and not os.path.exists(n.partition("@")[0])
            and cached(n.partition("@")[0], "dataset") is None]


def missing_paths(models: Sequence[tuple[str, str | None]], data: Sequence[tuple[str, str | None]]) -> list[str]:
    """A dry run's warning per value this machine cannot read: (flag, path or hub id) of model flags, (flag, source
    list) of data flags (each source without its @DATA_DIR); unset flags are skipped."""
    named: list[tuple[str, str, RepoType]] = [(flag, path, "model") for flag, path in models if path is not None]
    named += [(flag, n.strip().partition("@")[0], "dataset") for flag, sources in data
              for n in (sources or "").split(",") if n.strip()]
    return [note for flag, name, kind in named if (note := missing_note(flag, name, kind)) is not None]


def read_sources(spec: DataSpec) -> list[Any]:
    """The records of every source of `spec`, blended as OpenRLHF does."""
    names = spec.names()
    weights = spec.weights()
    parts = []
    for name in names:
        rows = _read_source(name, spec)
        parts.append(rows if spec.max_count is None else rows[:spec.max_count])
    if weights is None or len(parts) == 1:
        return [row for part in parts for row in part]
    empty = [n for n, p in zip(names, parts) if not p]
    if empty:
        raise DataError(f"--{spec.flag}: {', '.join(empty)} has no records; it cannot be blended")
    return _interleave(parts, weights, spec.seed)
