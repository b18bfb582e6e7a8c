"""Prompt and dataset sources as OpenRLHF's blending_datasets reads them (comma lists, SOURCE@DATA_DIR, splits,
per-source max counts, probability blending through datasets' own interleave_datasets) and as the hub names them,
on real files: jsonl/parquet data-file folders as repos hold them, save_to_disk DatasetDicts, and a hub cache laid
out as `hf download` leaves it, read with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from peer_data import lay_out_hub_cache, write_parquet, write_openrlhf_prompt_collection

from rlrun.data.prompts import PromptKeys, load_prompt_records
from rlrun.data.sources import DataSpec, missing_paths, not_here, read_sources
from rlrun.models import hub
from rlrun.runtime.errors import ConfigError, DataError


def _jsonl(path: Path, tag: str, n: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": f"{tag}{i}"}) + "\n" for i in range(n)))
    return path


def _prompts(rows: list[dict]) -> list[str]:
    return [r["prompt"] for r in rows]


def test_comma_lists_concatenate_with_a_max_count_per_source(tmp_path):
    a, b = _jsonl(tmp_path / "a.jsonl", "a", 3), _jsonl(tmp_path / "b.jsonl", "b", 4)
    assert _prompts(read_sources(DataSpec(f"{a}, {b}"))) == ["a0", "a1", "a2", "b0", "b1", "b2", "b3"]
    assert _prompts(read_sources(DataSpec(f"{a},{b}", max_count=2))) == ["a0", "a1", "b0", "b1"]
    with pytest.raises(DataError, match="has an empty entry"):
        read_sources(DataSpec(f"{a},,{b}"))


def test_probabilities_interleave_until_every_source_is_exhausted(tmp_path):
    a, b = _jsonl(tmp_path / "a.jsonl", "a", 3), _jsonl(tmp_path / "b.jsonl", "b", 6)
    mixed = _prompts(read_sources(DataSpec(f"{a},{b}", probs="0.5,0.5", seed=1)))
    assert {f"a{i}" for i in range(3)} | {f"b{i}" for i in range(6)} <= set(mixed)  # "all_exhausted"
    for tag in "ab":  # each source's records come in order, restarting once it has run out
        own = [p for p in mixed if p[0] == tag]
        n = 3 if tag == "a" else 6
        assert own == [f"{tag}{i % n}" for i in range(len(own))]
    assert mixed == _prompts(read_sources(DataSpec(f"{a},{b}", probs="0.5,0.5", seed=1)))  # seeded
    assert mixed != _prompts(read_sources(DataSpec(f"{a},{b}", probs="0.5,0.5", seed=2)))
    for probs, message in (("0.5", "one positive weight per source"), ("1,0", "one positive weight per source"),
                           ("x,1", "must be comma-separated numbers")):
        with pytest.raises(DataError, match=message):
            read_sources(DataSpec(f"{a},{b}", probs=probs))


def test_data_file_folders_are_split_by_file_name_and_data_dir(tmp_path):
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    write_parquet(repo / "data" / "train-00000-of-00002.parquet", [{"prompt": "t0"}, {"prompt": "t1"}])
    write_parquet(repo / "data" / "train-00001-of-00002.parquet", [{"prompt": "t2"}])
    write_parquet(repo / "data" / "test-00000-of-00001.parquet", [{"prompt": "e0"}])
    assert _prompts(read_sources(DataSpec(str(repo)))) == ["t0", "t1", "t2"]
    assert _prompts(read_sources(DataSpec(str(repo), split="test"))) == ["e0"]
    with pytest.raises(DataError, match=r"has no 'validation' split; its data files: data/test-00000-of-00001.parquet"):
        read_sources(DataSpec(str(repo), split="validation"))
    plain = tmp_path / "plain"  # files named after no split: all of them are 'train'
    _jsonl(plain / "math.jsonl", "m", 2)
    _jsonl(plain / "code.jsonl", "c", 1)
    assert _prompts(read_sources(DataSpec(str(plain)))) == ["c0", "m0", "m1"]
    subsets = tmp_path / "subsets"
    _jsonl(subsets / "math" / "train.jsonl", "m", 2)
    _jsonl(subsets / "code" / "train.jsonl", "c", 1)
    assert _prompts(read_sources(DataSpec(f"{subsets}@math"))) == ["m0", "m1"]
    with pytest.raises(DataError, match="no folder 'poetry'"):
        read_sources(DataSpec(f"{subsets}@poetry"))


def test_a_saved_dataset_dict_gives_the_asked_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_list([{"prompt": "t"}]),
                          "test": datasets.Dataset.from_list([{"prompt": "e"}])}).save_to_disk(tmp_path / "dd")
    assert _prompts(read_sources(DataSpec(str(tmp_path / "dd"), split="test"))) == ["e"]
    with pytest.raises(DataError, match=r"without a 'dev' split \(splits: \['test', 'train'\]\)"):
        read_sources(DataSpec(str(tmp_path / "dd"), split="dev"))


def test_a_hub_dataset_id_reads_from_the_cache_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.resolve.cache_clear()
    files = tmp_path / "files"
    (files / "data").mkdir(parents=True)
    collection = write_openrlhf_prompt_collection(tmp_path / "rows.jsonl", [{"prompt": "Write digits:", "label": "d"}],
                                                  system="Be brief.")
    write_parquet(files / "data" / "train-00000-of-00001.parquet",
                   [json.loads(line) for line in collection.read_text().splitlines()])
    lay_out_hub_cache(tmp_path / "hub", "OpenRLHF/prompt-collection-v0.1", files, repo_type="dataset")
    records = load_prompt_records(DataSpec("OpenRLHF/prompt-collection-v0.1"), PromptKeys("context_messages", "label"))
    assert records[0].prompt == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write digits:"}]
    assert records[0].label == "d"
    with pytest.raises(ConfigError, match="OpenRLHF/other is not in the Hugging Face cache"):
        load_prompt_records(DataSpec("OpenRLHF/other"))
    hub.resolve.cache_clear()


def test_dry_runs_find_hub_datasets_in_the_cache_and_name_the_rest(tmp_path, monkeypatch):
    """A hub dataset in this machine's hub cache (HF_HOME/hub here) is here: no warning, and the preflight reads it; a
    hub id not in the cache, an earlier stage's output (`out/pairs`) and another host's file are named instead."""
    files = tmp_path / "files"
    _jsonl(files / "train.jsonl", "p", 2)
    lay_out_hub_cache(tmp_path / "home" / "hub", "OpenRLHF/pairs", files, repo_type="dataset")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    local = _jsonl(tmp_path / "local.jsonl", "l", 1)
    sources = f"OpenRLHF/pairs@.,{local},out/pairs,/other/host.jsonl,OpenRLHF/uncached"
    assert not_here(sources) == ["out/pairs", "/other/host.jsonl", "OpenRLHF/uncached"]
    warnings = missing_paths([("pretrain", str(tmp_path)), ("ref_pretrain", None)], [("dataset", sources),
                                                                                    ("eval_dataset", None)])
    assert [w.split(":")[0] for w in warnings] == ["--dataset out/pairs", "--dataset /other/host.jsonl",
                                                   "--dataset OpenRLHF/uncached"]
    assert "a path not written yet (an earlier stage's output?), or a Hugging Face Hub dataset id" in warnings[0]
    assert warnings[1].endswith("not found on this machine (another host's path?)")
    hub.resolve.cache_clear()
    assert _prompts(read_sources(DataSpec("OpenRLHF/pairs"))) == ["p0", "p1"]
    hub.resolve.cache_clear()
