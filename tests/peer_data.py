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
"""

from __future__ import annotations

import json
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


def _write_parquet(path: Path, rows: list[dict]) -> Path:
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
    return _write_parquet(path, rows)


def write_search_r1_nq(path: Path, records: list[dict], split: str = "train") -> Path:
    """records: rlrun's examples/search_r1/train.jsonl rows ({"prompt", "question", "golden_answers"}) -> Search-R1's
    nq_search parquet (its prompt is already Search-R1's base instruction + question)."""
    rows = [{"id": f"{split}_{i}", "question": r["question"], "golden_answers": r["golden_answers"],
             "data_source": "nq", "prompt": [{"role": "user", "content": r["prompt"]}], "ability": "fact-reasoning",
             "reward_model": {"style": "rule", "ground_truth": {"target": r["golden_answers"]}},
             "extra_info": {"split": split, "index": i}}
            for i, r in enumerate(records)]
    return _write_parquet(path, rows)
