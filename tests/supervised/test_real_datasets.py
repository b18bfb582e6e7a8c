"""SFT, RM and DPO samples rendered by Qwen's official tokenizer (Qwen3's template: an empty think block before
every final assistant answer, `<|im_end|>` as eos) on GSM8K's real questions and answers, in OpenRLHF's layouts:
the loss covers exactly the answer as the template renders it, the prompt tokens are those a generation would start
from, and a cut sample still ends with the eos."""

from __future__ import annotations

import json

import pytest

from real_artefacts import IM_END, released
from rlrun.supervised.datasets import load_completions, load_preferences

THINK = "<think>\n\n</think>\n\n"  # what Qwen3's template puts before a final answer that has no reasoning


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return released("gsm8k", "train")[:24]


def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_sft_question_answer_rows(rows, qwen_tokenizer, tmp_path):
    """OpenRLHF's `--input_key question --output_key answer --apply_chat_template`."""
    data = _write(tmp_path / "sft.jsonl", rows)
    loaded = load_completions(data, qwen_tokenizer, input_key="question", output_key="answer", input_template=None,
                              apply_chat_template=True, pretrain_mode=False, max_len=4096, max_samples=100)
    assert len(loaded.samples) == 24 and loaded.dropped == loaded.truncated == 0
    for row, sample in zip(rows, loaded.samples):
        prompt = qwen_tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}], tokenize=False,
                                                    add_generation_prompt=True)
        assert sample.prompt == qwen_tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert qwen_tokenizer.decode(sample.response) == f"{THINK}{row['answer']}<|im_end|>"
        assert sample.response[-1] == IM_END and IM_END not in sample.response[:-1]  # one eos, the template's


def test_sft_conversations_and_a_cut_sample(rows, qwen_tokenizer, tmp_path):
    """Whole conversations in one field (`--input_key messages --apply_chat_template`), with a system turn; at a
    max_len shorter than the sample the cut keeps the prompt and ends the answer with the eos (OpenRLHF's rule)."""
    chats = [{"messages": [{"role": "system", "content": "Answer with #### and the number."},
                           {"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]}
             for r in rows]
    data = _write(tmp_path / "chats.jsonl", chats)
    full = load_completions(data, qwen_tokenizer, input_key="messages", output_key=None, input_template=None,
                            apply_chat_template=True, pretrain_mode=False, max_len=4096, max_samples=100)
    assert qwen_tokenizer.decode(full.samples[0].prompt).startswith(
        "<|im_start|>system\nAnswer with #### and the number.<|im_end|>\n<|im_start|>user\n")
    assert qwen_tokenizer.decode(full.samples[0].response).endswith("#### 72<|im_end|>")
    cut_at = len(full.samples[0].prompt) + 10
    cut = load_completions(data, qwen_tokenizer, input_key="messages", output_key=None, input_template=None,
                           apply_chat_template=True, pretrain_mode=False, max_len=cut_at, max_samples=1)
    sample = cut.samples[0]
    assert cut.truncated == 1 and sample.prompt == full.samples[0].prompt
    assert sample.response == full.samples[0].response[:9] + [IM_END]


@pytest.mark.parametrize("task", ["reward_model", "dpo"])
def test_preference_pairs(rows, qwen_tokenizer, tmp_path, task):
    """OpenRLHF's preference layout with chat messages (`--prompt_key prompt --chosen_key chosen --rejected_key
    rejected --apply_chat_template`): the right answer against another question's."""
    pairs = [{"prompt": [{"role": "user", "content": r["question"]}],
              "chosen": [{"role": "assistant", "content": r["answer"]}],
              "rejected": [{"role": "assistant", "content": rows[(i + 1) % len(rows)]["answer"]}]}
             for i, r in enumerate(rows)]
    data = _write(tmp_path / "pairs.jsonl", pairs)
    loaded = load_preferences(data, qwen_tokenizer, prompt_key="prompt", chosen_key="chosen", rejected_key="rejected",
                              input_template=None, apply_chat_template=True, max_len=4096, max_samples=100, task=task)
    assert len(loaded.samples) == 24
    first = loaded.samples[0]
    assert qwen_tokenizer.decode(first.prompt).endswith("<|im_start|>assistant\n")
    assert qwen_tokenizer.decode(first.chosen) == f"{THINK}{rows[0]['answer']}<|im_end|>"
    assert qwen_tokenizer.decode(first.rejected) == f"{THINK}{rows[1]['answer']}<|im_end|>"
