"""Prompt loading for every format and error path, prompt formatting, sampler order, tokenization."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from rlrun.data.prompts import PromptKeys, PromptRecord, PromptSampler, format_prompt, load_prompt_records, tokenize_prompts
from rlrun.models.tiny import BUILTIN_PROMPTS, build_byte_tokenizer
from rlrun.runtime.errors import DataError, MissingExtraError

ROWS = [
    {"question": "What is 1+1?", "answer": "2", "other": "x"},
    {"question": "Spell cat.", "answer": "cat", "other": "y"},
    {"question": "日本語?", "answer": "yes", "other": "z"},
]
EXPECTED = [PromptRecord(prompt=r["question"], label=r["answer"]) for r in ROWS]


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows) + "\n", encoding="utf-8")
    return path


def _write(tmp_path: Path, kind: str, rows: list) -> Path:
    if kind == "jsonl":
        return _write_jsonl(tmp_path / "p.jsonl", rows)
    if kind == "json":
        path = tmp_path / "p.json"
        path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
        return path
    if kind == "csv":
        path = tmp_path / "p.csv"
        with open(path, "w", encoding="utf-8", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        return path
    if kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "p.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        return path
    import datasets

    path = tmp_path / kind
    dataset = datasets.Dataset.from_list(rows)
    if kind == "dataset_dict":
        dataset = datasets.DatasetDict({"train": dataset, "test": dataset.select([0])})
    dataset.save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "dataset", "dataset_dict"])
def test_load_every_format(tmp_path: Path, kind: str) -> None:
    path = str(_write(tmp_path, kind, ROWS))
    assert load_prompt_records(path, PromptKeys("question", "answer")) == EXPECTED
    unlabeled = load_prompt_records(path, PromptKeys("question"), max_samples=2)
    assert unlabeled == [PromptRecord(prompt=r["question"], label=None) for r in ROWS[:2]]


def test_builtin_prompts_ignore_keys() -> None:
    records = load_prompt_records(None, PromptKeys("ignored"))
    assert len(records) == len(BUILTIN_PROMPTS)
    assert records[0] == PromptRecord(prompt=BUILTIN_PROMPTS[0]["prompt"], label=BUILTIN_PROMPTS[0]["label"])
    assert len(load_prompt_records(None, max_samples=5)) == 5


def test_labels_keep_their_type(tmp_path: Path) -> None:
    """As OpenRLHF hands them to reward_func: the dataset's value, not text."""
    path = _write_jsonl(tmp_path / "n.jsonl", [{"prompt": "1+1", "label": 2}, {"prompt": "x", "label": 0.5}])
    assert [r.label for r in load_prompt_records(str(path), PromptKeys(label_key="label"))] == [2, 0.5]


def test_missing_path(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="does not exist") as info:
        load_prompt_records(missing)
    assert missing in str(info.value)


def test_unknown_extension(tmp_path: Path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("hello")
    with pytest.raises(DataError, match=r"unsupported extension '\.txt'.*\.jsonl") as info:
        load_prompt_records(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize("content", ["", "\n\n", "[]"])
def test_empty_dataset(tmp_path: Path, content: str) -> None:
    path = tmp_path / ("p.json" if content == "[]" else "p.jsonl")
    path.write_text(content)
    with pytest.raises(DataError, match="is empty"):
        load_prompt_records(str(path))


def test_missing_input_key_lists_keys_and_suggests(tmp_path: Path) -> None:
    path = str(_write(tmp_path, "jsonl", ROWS))
    with pytest.raises(DataError) as info:
        load_prompt_records(path, PromptKeys("questions"))
    message = str(info.value)
    assert "'questions'" in message and path in message
    assert "['question', 'answer', 'other']" in message
    assert "Did you mean 'question'?" in message


def test_list_and_dict_labels_stay_objects(tmp_path: Path) -> None:
    """Search-R1's golden_answers lists (and verl's {"target": [...]}) reach rewards and agents as the objects."""
    path = _write_jsonl(tmp_path / "l.jsonl", [{"prompt": "q", "label": ["Paris", "paris, France"]},
                                               {"prompt": "r", "label": {"target": ["1889"]}}])
    labels = [r.label for r in load_prompt_records(str(path), PromptKeys(label_key="label"))]
    assert labels == [["Paris", "paris, France"], {"target": ["1889"]}]


def test_missing_label_key(tmp_path: Path) -> None:
    path = str(_write(tmp_path, "csv", ROWS))
    with pytest.raises(DataError) as info:
        load_prompt_records(path, PromptKeys("question", "answers"))
    message = str(info.value)
    assert "label_key 'answers'" in message and "Did you mean 'answer'?" in message


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_null_label_is_refused_like_a_missing_one(tmp_path: Path, kind: str) -> None:
    """Issue 64: verl's layout with reward_model.ground_truth null (JSON null; in parquet the struct field's null) was
    scored against None (reward 0) without a word; it is refused, naming the record."""
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": "openai/gsm8k",
             "reward_model": {"style": "rule", "ground_truth": None if i == 2 else str(i)}} for i in range(4)]
    if kind == "jsonl":
        path = _write_jsonl(tmp_path / "v.jsonl", rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "v.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=r"record 2 has label_key 'reward_model.ground_truth' = null; .*fill it in"):
        load_prompt_records(str(path), PromptKeys(label_key="reward_model.ground_truth"))
    assert len(load_prompt_records(str(path), PromptKeys())) == 4  # without --label_key no label is read


def test_non_string_prompt(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"prompt": ["a", "list"]}])
    with pytest.raises(DataError, match=r"record 1 has 'prompt' = .*\(list\); a prompt must be a string or a list of "):
        load_prompt_records(str(path))


def test_bad_json_shapes(tmp_path: Path) -> None:
    wrapped = tmp_path / "w.json"
    wrapped.write_text(json.dumps({"data": ROWS}))
    with pytest.raises(DataError, match="must be a list of objects"):
        load_prompt_records(str(wrapped))
    broken = tmp_path / "b.jsonl"
    broken.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(DataError, match=r"b\.jsonl: record 1 \(line 2\) is not valid JSON"):
        load_prompt_records(str(broken))
    # Records count from 0 everywhere (as indexes), lines from 1 (as editors); a bad byte names its line.
    latin1 = tmp_path / "l.jsonl"
    latin1.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"l\.jsonl: line 2 is not UTF-8 text \(byte 0xe9 at offset 31\); save the file as UTF-8"):
        load_prompt_records(str(latin1))
    latin1_csv = tmp_path / "l.csv"
    latin1_csv.write_bytes(b"prompt\nok\ncaf\xe9\n")
    with pytest.raises(DataError, match=r"l\.csv: line 3 is not UTF-8"):
        load_prompt_records(str(latin1_csv), PromptKeys("prompt"))
    scalars = _write_jsonl(tmp_path / "s.jsonl", ["just a string"])
    with pytest.raises(DataError, match="must be an object"):
        load_prompt_records(str(scalars))


def test_dataset_dict_without_train_and_plain_dir(tmp_path: Path) -> None:
    import datasets

    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"without a 'train' split \(splits: \['test'\]\)"):
        load_prompt_records(str(tmp_path / "dd"), PromptKeys("question"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="holds no data files .* and was not written by save_to_disk"):
        load_prompt_records(str(tmp_path / "plain"))


@pytest.mark.parametrize(
    ("kind", "module", "package"), [("dataset", "datasets", "datasets"), ("parquet", "pyarrow.parquet", "pyarrow")]
)
def test_missing_optional_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, module: str, package: str
) -> None:
    path = str(_write(tmp_path, kind, ROWS))
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` raise ImportError
    with pytest.raises(MissingExtraError, match=rf"'{package}'.*rlrun\[data\]") as info:
        load_prompt_records(path, PromptKeys("question"))
    assert info.value.extra == "data"


def test_bad_max_samples() -> None:
    with pytest.raises(DataError, match="max_samples=0"):
        load_prompt_records(None, max_samples=0)


def test_format_prompt_modes(tokenizer) -> None:
    assert format_prompt("Hi", tokenizer, None, False) == "Hi"
    assert format_prompt("Hi", tokenizer, "Q: {}\nA:", False) == "Q: Hi\nA:"
    assert format_prompt("Hi", tokenizer, "Q: {}", True) == "User: Hi\nAssistant: "


def test_format_prompt_errors(tokenizer) -> None:
    with pytest.raises(DataError, match=r"'Q: \{prompt\}' has no '\{\}'"):
        format_prompt("Hi", tokenizer, "Q: {prompt}", False)
    with pytest.raises(DataError, match="escape literal braces"):
        format_prompt("Hi", tokenizer, '{"q": {}}', False)
    bare = build_byte_tokenizer()
    bare.chat_template = None
    with pytest.raises(DataError, match="no chat_template"):
        format_prompt("Hi", bare, None, True)


def test_sampler_covers_each_record_once_per_episode() -> None:
    sampler = PromptSampler(num_records=10, rollout_batch_size=3, seed=7, num_episodes=3)
    assert sampler.steps_per_episode == 3 and sampler.total_steps == 9
    for episode in range(3):
        steps = range(episode * 3, episode * 3 + 3)
        seen = [i for step in steps for i in sampler.indices(step)]
        assert len(seen) == 9 and len(set(seen)) == 9 and set(seen) <= set(range(10))
        assert all(sampler.episode_of(step) == episode for step in steps)
    # Exact division: every record appears exactly once.
    exact = PromptSampler(num_records=12, rollout_batch_size=4, seed=0, num_episodes=1)
    assert sorted(i for step in range(3) for i in exact.indices(step)) == list(range(12))


def test_sampler_episodes_differ_and_seed_repeats() -> None:
    a = PromptSampler(num_records=64, rollout_batch_size=8, seed=1, num_episodes=2)
    b = PromptSampler(num_records=64, rollout_batch_size=8, seed=1, num_episodes=2)
    c = PromptSampler(num_records=64, rollout_batch_size=8, seed=2, num_episodes=2)
    assert a.permutation(0) != a.permutation(1)
    assert [a.indices(s) for s in range(16)] == [b.indices(s) for s in range(16)]
    assert a.permutation(0) != c.permutation(0)


def test_sampler_indices_are_stateless() -> None:
    in_order = PromptSampler(num_records=20, rollout_batch_size=4, seed=3, num_episodes=3)
    expected = [in_order.indices(s) for s in range(in_order.total_steps)]
    resumed = PromptSampler(num_records=20, rollout_batch_size=4, seed=3, num_episodes=3)
    for step in [11, 2, 14, 0, 7, 7, 5]:  # any order, repeats: same answer as a fresh run
        assert resumed.indices(step) == expected[step]


def test_sampler_errors() -> None:
    with pytest.raises(DataError, match=r"Only 3 prompt records for rollout_batch_size=4"):
        PromptSampler(num_records=3, rollout_batch_size=4, seed=0, num_episodes=1)
    with pytest.raises(DataError, match="num_episodes=0"):
        PromptSampler(num_records=3, rollout_batch_size=1, seed=0, num_episodes=0)
    sampler = PromptSampler(num_records=4, rollout_batch_size=2, seed=0, num_episodes=1)
    with pytest.raises(DataError, match=r"step=2 is outside \[0, 2\)"):
        sampler.indices(2)


def test_tokenize_prompts_truncates_from_the_left(tokenizer) -> None:
    ids, truncated = tokenize_prompts(["abc", "abcdefgh", "héllo"], tokenizer, prompt_max_len=5)
    assert truncated == 2
    assert ids[0] == [97, 98, 99]
    assert ids[1] == list(b"defgh")
    assert ids[2] == list("héllo".encode())[-5:]
    assert tokenize_prompts([], tokenizer, 5) == ([], 0)


def test_tokenize_prompts_errors(tokenizer) -> None:
    with pytest.raises(DataError, match="prompt_max_len=0"):
        tokenize_prompts(["a"], tokenizer, 0)
    with pytest.raises(DataError, match="Prompt 1 .* no tokens"):
        tokenize_prompts(["a", ""], tokenizer, 4)
