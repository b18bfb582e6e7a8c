"""Test files in the peers' exact schemas (a module name no other test folder uses).

- OpenRLHF's prompt-collection-v0.1 (the Slurm PPO job's `--input_key context_messages --apply_chat_template`):
  columns `dataset`, `context`, `context_messages` (a list of {"content", "role"} messages, some with a system
  turn), `id`; as a JSONL file, one object per line.
- verl's examples/data_preprocess/gsm8k.py parquet: `data_source` "openai/gsm8k", `prompt` [{"role": "user",
  "content": question + " " + instruction}], `ability` "math", `reward_model` {"style": "rule", "ground_truth":
  the answer as text}, `extra_info` {"split", "index", "answer", "question"}.
- Search-R1's scripts/data_process/nq_search.py parquet: `data_source` "nq", `prompt` [{"role": "user",
  "content": Search-R1's "base" instruction + question}], `ability` "fact-reasoning", `reward_model`
  {"style": "rule", "ground_truth": {"target": [answers]}}, `extra_info` {"split", "index"}, plus FlashRAG's own
  columns `id`, `question`, `golden_answers` (not popped by the script).
- The Hugging Face hub cache as `huggingface_hub` lays it out (`hf download`): `{repo_type}s--{owner}--{name}/`
  with `refs/main` (the commit), `blobs/<sha256>` (the bytes) and `snapshots/<commit>/<path>` relative symlinks to
  the blobs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def write_openrlhf_prompt_collection(path: Path, prompts: list[dict[str, str]], system: str | None = None) -> Path:
    """prompts: [{"prompt": text, "label": label}] -> OpenRLHF prompt-collection rows (+ the label column)."""
    with open(path, "w", encoding="utf-8") as out:
        for i, row in enumerate(prompts):
            messages = ([{"content": system, "role": "system"}] if system and i % 2 == 0 else []) + \
                       [{"content": row["prompt"], "role": "user"}]
            out.write(json.dumps({"dataset": "demo", "context": row["prompt"], "context_messages": messages,
                                  "id": f"demo-{i}", "label": row["label"]}) + "\n")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_verl_gsm8k(path: Path, questions: list[tuple[str, str]], split: str = "train") -> Path:
    """questions: [(question, answer text)] -> verl's gsm8k parquet."""
    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": question + " " + GSM8K_INSTRUCTION}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": answer},
             "extra_info": {"split": split, "index": i, "answer": f"... #### {answer}", "question": question}}
            for i, (question, answer) in enumerate(questions)]
    return write_parquet(path, rows)


def write_search_r1_nq(path: Path, records: list[dict], split: str = "train") -> Path:
    """records: rlrun's examples/search_r1/train.jsonl rows ({"prompt", "question", "golden_answers"}) -> Search-R1's
    nq_search parquet (its prompt is already Search-R1's base instruction + question)."""
    rows = [{"id": f"{split}_{i}", "question": r["question"], "golden_answers": r["golden_answers"],
             "data_source": "nq", "prompt": [{"role": "user", "content": r["prompt"]}], "ability": "fact-reasoning",
             "reward_model": {"style": "rule", "ground_truth": {"target": r["golden_answers"]}},
             "extra_info": {"split": split, "index": i}}
            for i, r in enumerate(records)]
    return write_parquet(path, rows)


def lay_out_hub_cache(cache: Path, repo_id: str, files_from: Path, repo_type: str = "model",
                      commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """Put the files under `files_from` into the hub cache at `cache` as repo `repo_id`; returns the snapshot."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir(exist_ok=True)
    for path in sorted(p for p in files_from.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / path.relative_to(files_from)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot
