"""Embedded defaults for an offline machine: a byte tokenizer, tiny model configs, a prompt set.

Nothing here touches the network or the model hub, so the demo, the tests and the
benchmarks run on a bare machine and every process builds the same objects.
"""

from __future__ import annotations

from typing import TypedDict

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config

from rlrun.models.architecture import policy_auto_class, tied_embeddings
from rlrun.runtime.errors import ConfigError

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
NUM_BYTES = 256
# Ids are fixed by construction (bytes 0..255, then the specials in order) so configs can
# be written without building a tokenizer first.
PAD_ID, BOS_ID, EOS_ID = NUM_BYTES, NUM_BYTES + 1, NUM_BYTES + 2
BYTE_VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)

# Assistant turns end with EOS so that SFT-style data teaches the model to stop; the
# generation prompt ends with a space so the response itself starts with content.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}{{ eos_token }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character map, which the ByteLevel decoder inverts."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    mapping: dict[int, str] = {b: chr(b) for b in printable}
    shift = 0
    for b in range(NUM_BYTES):
        if b not in mapping:
            mapping[b] = chr(NUM_BYTES + shift)
            shift += 1
    return mapping


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 259-token byte-level tokenizer: token id == byte value, then pad, bos, eos.

    No merges, so any UTF-8 text round-trips exactly and the vocabulary is tiny. No BOS is
    prepended when encoding (there is no post-processor): prompts are passed through as-is,
    matching how the trainer tokenizes with add_special_tokens=False.
    """
    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    bpe = models.BPE(vocab=vocab, merges=[])
    backend = Tokenizer(bpe)
    # add_prefix_space=False: a leading space would break decode(encode(s)) == s.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",  # generation batches are left-padded so prompts end aligned
        clean_up_tokenization_spaces=False,  # cleanup would rewrite " ." and break round trips
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


class _SpecialIds(TypedDict):
    pad_token_id: int
    bos_token_id: int
    eos_token_id: int


def _special_ids() -> _SpecialIds:
    return {"pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID}


def tiny_model_config(vocab_size: int = BYTE_VOCAB_SIZE) -> PretrainedConfig:
    """A ~110k-parameter Qwen2 causal LM: small enough to train by RL on two CPU cores."""
    if vocab_size < BYTE_VOCAB_SIZE:
        raise ConfigError(
            f"vocab_size={vocab_size} is smaller than the byte tokenizer's {BYTE_VOCAB_SIZE} tokens; "
            f"pass vocab_size >= {BYTE_VOCAB_SIZE} (e.g. len(build_byte_tokenizer()))."
        )
    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        # head_dim 32 (not 4 x 16): vLLM's CPU attention needs head_dim >= 32; the projection shapes
        # (64x64 q/o, 64x32 k/v) are the same as with 4 query / 2 KV heads of 16.
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **_special_ids(),
    )


class _Preset(TypedDict):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int


# Larger presets for benchmarks. The byte vocab makes embeddings negligible, so "0.5b" keeps
# Qwen2-0.5B's widths but uses 32 layers instead of 24 to land near 0.5B parameters.
_PRESETS: dict[str, _Preset] = {
    # Benchmark-only: the ~3.1M-parameter shape of the issue-10 GRPO comparison with TRL.
    "3m": {
        "hidden_size": 256,
        "intermediate_size": 704,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
    },
    "100m": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "max_position_embeddings": 4096,
    },
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 32,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
    },
}
MODEL_SIZES: tuple[str, ...] = ("tiny", *_PRESETS)


def tiny_model_config_for_size(name: str) -> PretrainedConfig:
    """Preset Qwen2 configs over the byte vocab: "tiny" (~110k), "3m" (~3.1M), "100m" (~104M), "0.5b" (~0.48B)."""
    if name == "tiny":
        return tiny_model_config()
    if name not in _PRESETS:
        raise ConfigError(f"Unknown model size {name!r}; choose one of {list(MODEL_SIZES)}.")
    return Qwen2Config(vocab_size=BYTE_VOCAB_SIZE, tie_word_embeddings=False, **_PRESETS[name], **_special_ids())


def build_causal_lm(config: PretrainedConfig, seed: int, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Randomly initialised causal LM, identical in every process that passes the same seed.

    Initialisation draws from torch's global CPU RNG, so it runs inside fork_rng: the caller's
    RNG stream (data order, dropout, sampling) is the same whether or not a model was built.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = policy_auto_class(config).from_config(config, dtype=dtype)
    head, text = model.get_output_embeddings(), config.get_text_config()
    if not tied_embeddings(config) and isinstance(head, torch.nn.Linear):
        # HF's init (std 0.02) gives a width-64 model near-uniform logits (std 0.16) whose spread only the head itself
        # can change: adapters on the body (LoRA all-linear leaves the head out) cannot lift any token past ~1.5%.
        # std 1/sqrt(hidden), as a trained LM's logits spread, makes the random model learnable through its body too.
        with torch.no_grad():
            head.weight.mul_(1.0 / (text.hidden_size**0.5 * text.initializer_range))
    return model


def _builtin_prompts() -> list[dict[str, str]]:
    """64 prompts, two tasks interleaved; the task word sits right before the final colon."""
    openers = ["Write", "Type", "Print", "Give me", "List", "Say", "Output", "Show"]
    amounts = ["some", "a few", "only", "many"]
    records: list[dict[str, str]] = []
    for opener in openers:
        for amount in amounts:
            for label in ("digits", "letters"):
                records.append({"prompt": f"{opener} {amount} {label}:", "label": label})
    return records


BUILTIN_PROMPTS: list[dict[str, str]] = _builtin_prompts()
