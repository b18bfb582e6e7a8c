"""Generated data for the offline pipeline on the embedded tiny model (SFT -> RM -> PPO, and DPO): the built-in
demo task (rlrun.models.tiny.BUILTIN_PROMPTS: answer with digits, or with lowercase letters) as SFT records and
preference pairs whose chosen answer keeps to the asked characters and whose rejected answer does not.

    python -m rlrun.supervised.demo_data OUT_DIR   # writes sft.jsonl, pairs.jsonl, pairs_eval.jsonl
"""

from __future__ import annotations

import json
import os
import random
import string
import sys

from rlrun.models.tiny import BUILTIN_PROMPTS
from rlrun.rewards.demo import TARGET_CHARS

# Characters of the wrong kind for each label: uppercase letters and punctuation, and the other label's set.
_OFF_TARGET = {label: "".join(sorted(set(string.ascii_uppercase + string.punctuation + "".join(other))))
               for label in TARGET_CHARS for other_label, other in TARGET_CHARS.items() if other_label != label}


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
        sys.exit("usage: python -m rlrun.supervised.demo_data OUT_DIR")
    for name, path in write_all(sys.argv[1]).items():
        print(f"{name}: {path}")
