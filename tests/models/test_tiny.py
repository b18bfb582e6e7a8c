"""Offline defaults: byte tokenizer, tiny model configs and weights, built-in prompts, demo reward."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import AutoTokenizer

from rlrun.rewards.demo import reward_func, target_fraction
from rlrun.runtime.errors import ConfigError, RewardError
from rlrun.models.tiny import (
    BUILTIN_PROMPTS,
    BYTE_VOCAB_SIZE,
    build_byte_tokenizer,
    build_causal_lm,
    tiny_model_config,
    tiny_model_config_for_size,
)

TEXTS = ["hello world", "  leading and trailing  ", "héllo wörld, 日本語 🎉\n\ttabs", "a <|eos|> b", ""]


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def tiny_model():
    return build_causal_lm(tiny_model_config(), seed=0)


def test_tokenizer_specials_and_vocab(tokenizer) -> None:
    assert len(tokenizer) == 256 + 3 == BYTE_VOCAB_SIZE
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (256, 257, 258)
    assert tokenizer.padding_side == "left"
    # Byte tokens: id == byte value, and no BOS is prepended.
    assert tokenizer.encode("Az\u00e9") == [65, 122, 0xC3, 0xA9]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_decode_encode_round_trip(tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tokenizer_is_deterministic_and_survives_save_load(tokenizer, tmp_path) -> None:
    assert build_byte_tokenizer().encode(TEXTS[2]) == tokenizer.encode(TEXTS[2])
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert loaded.encode(text) == tokenizer.encode(text)
        assert loaded.decode(loaded.encode(text)) == text
    assert loaded.padding_side == "left"
    assert loaded.pad_token_id == 256 and loaded.eos_token_id == 258
    assert loaded.chat_template == tokenizer.chat_template


def test_left_padding_batch(tokenizer) -> None:
    batch = tokenizer(["ab", "abcd"], padding=True, add_special_tokens=False)
    assert batch["input_ids"][0] == [256, 256, 97, 98]
    assert batch["attention_mask"][0] == [0, 0, 1, 1]


def test_chat_template_renders(tokenizer) -> None:
    messages = [{"role": "user", "content": "Write some digits:"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "User: Write some digits:\nAssistant: "
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == "User: Write some digits:\n"
    turn = messages + [{"role": "assistant", "content": "123"}]
    assert tokenizer.apply_chat_template(turn, tokenize=False).endswith("Assistant: 123<|eos|>\n")


def test_tiny_config_matches_tokenizer(tokenizer) -> None:
    config = tiny_model_config(len(tokenizer))
    assert config.model_type == "qwen2"
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (64, 2, 128)
    assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1)  # head_dim 32: vLLM CPU needs >= 32
    assert config.max_position_embeddings == 512 and config.tie_word_embeddings is False
    assert config.vocab_size == len(tokenizer)
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    with pytest.raises(ConfigError, match="vocab_size=100"):
        tiny_model_config(100)


@pytest.mark.parametrize(
    ("name", "low", "high"), [("tiny", 0.08e6, 0.15e6), ("3m", 2.9e6, 3.3e6), ("100m", 90e6, 120e6), ("0.5b", 0.42e9, 0.55e9)]
)
def test_size_presets_parameter_counts(name: str, low: float, high: float) -> None:
    config = tiny_model_config_for_size(name)
    assert config.vocab_size == BYTE_VOCAB_SIZE and config.eos_token_id == 258
    with torch.device("meta"):  # counts parameters without allocating or initialising them
        model = build_causal_lm(config, seed=0)
    assert low < sum(p.numel() for p in model.parameters()) < high


def test_unknown_size_preset() -> None:
    with pytest.raises(ConfigError, match="'7b'.*tiny"):
        tiny_model_config_for_size("7b")


def test_same_seed_same_weights_and_global_rng_untouched(tiny_model) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    again = build_causal_lm(tiny_model_config(), seed=0)
    assert torch.equal(torch.rand(3), expected)
    for (name, a), (_, b) in zip(tiny_model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    other = build_causal_lm(tiny_model_config(), seed=1)
    assert not torch.equal(tiny_model.lm_head.weight, other.lm_head.weight)
    assert not torch.equal(tiny_model.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_generate_runs_on_cpu(tiny_model, tokenizer) -> None:
    batch = tokenizer(["Write some digits:", "Hi"], return_tensors="pt", padding=True, add_special_tokens=False)
    out = tiny_model.generate(**batch, do_sample=False, max_new_tokens=4, pad_token_id=tokenizer.pad_token_id)
    prompt_len = batch["input_ids"].shape[1]
    assert out.shape[0] == 2 and prompt_len < out.shape[1] <= prompt_len + 4
    assert torch.equal(out[:, : batch["input_ids"].shape[1]], batch["input_ids"])


def test_builtin_prompts() -> None:
    assert len(BUILTIN_PROMPTS) == 64
    assert all(set(r) == {"prompt", "label"} for r in BUILTIN_PROMPTS)
    assert {r["label"] for r in BUILTIN_PROMPTS} == {"digits", "letters"}
    assert sum(r["label"] == "digits" for r in BUILTIN_PROMPTS) == 32
    assert len({r["prompt"] for r in BUILTIN_PROMPTS}) == 64
    assert all(r["label"] in r["prompt"] for r in BUILTIN_PROMPTS)


def test_reward_by_hand() -> None:
    prompts = ["P:", "P:", "P:", "Q:", "Q:", "Q:"]
    responses = ["0123456789", "12ab", "", "abcxyz", "ab12", "ABC!"]
    labels = ["digits", "digits", "digits", "letters", "letters", "letters"]
    out = reward_func([p + r for p, r in zip(prompts, responses)], prompts, labels)
    expected = torch.tensor([1.0, 0.5, 0.0, 1.0, 0.5, 0.0])
    assert out["rewards"].dtype == torch.float32 and out["rewards"].shape == (6,)
    assert torch.equal(out["rewards"], expected) and torch.equal(out["scores"], expected)
    assert out["extra_logs"]["response_chars"].tolist() == [10, 4, 0, 6, 4, 4]
    assert out["extra_logs"]["empty_response"].tolist() == [0, 0, 1, 0, 0, 0]


def test_reward_label_dispatch_and_specials() -> None:
    query = "Write:123abc"
    out = reward_func([query, query], ["Write:", "Write:"], ["digits", "letters"])
    assert out["rewards"].tolist() == [0.5, 0.5]
    # Special-token text is not part of what the policy wrote.
    assert reward_func(["<|bos|>P:42<|eos|><|pad|>"], ["P:"], ["digits"])["rewards"].tolist() == [1.0]
    assert target_fraction("a1", "digits") == 0.5


def test_reward_errors() -> None:
    with pytest.raises(RewardError, match="'numbers'"):
        reward_func(["P:1"], ["P:"], ["numbers"])
    with pytest.raises(RewardError, match="does not start with"):
        reward_func(["X:1"], ["P:"], ["digits"])
    with pytest.raises(RewardError, match="2 queries, 1 prompts"):
        reward_func(["P:1", "P:2"], ["P:"], ["digits"])


def test_random_init_baseline(tiny_model, tokenizer) -> None:
    torch.manual_seed(0)
    prompts = [r["prompt"] for r in BUILTIN_PROMPTS]
    labels = [r["label"] for r in BUILTIN_PROMPTS]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = tiny_model.generate(
            **batch, do_sample=True, top_k=0, top_p=1.0, max_new_tokens=32, pad_token_id=tokenizer.pad_token_id
        )
    responses = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    rewards = reward_func([p + r for p, r in zip(prompts, responses)], prompts, labels)["rewards"]
    # Near-uniform bytes: ~10/256 digits and ~26/256 letters, ~0.07 averaged over both tasks.
    assert 0.03 < rewards.mean().item() < 0.12
    is_digits = torch.tensor([label == "digits" for label in labels])
    assert rewards[is_digits].mean() < rewards[~is_digits].mean()
