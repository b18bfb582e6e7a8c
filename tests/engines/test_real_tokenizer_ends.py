"""Responses end where a Qwen model's responses end, in the native and HF engines, with Qwen's real tokenizer (eos
`<|im_end|>`) and the generation_config.json Qwen ships (eos ids [<|im_end|>, <|endoftext|>]): vLLM and HF generate
stop on every listed id, and so must rlrun, or a response runs on past `<|endoftext|>` to the length cap, is marked
truncated and its reward reads text the model never meant. The model is a tiny random Qwen2 over the real vocabulary
whose head favours `<|endoftext|>` (a stand-in for a trained model's habit; no pretrained Qwen runs on CPU here)."""

from __future__ import annotations

import pytest
import torch

from real_artefacts import ENDOFTEXT, IM_END, GSM8K_INSTRUCTION, released, save_qwen_vocab_model
from rlrun.config.model import PretrainedConfig
from rlrun.engines.hf import HFEngine
from rlrun.engines.protocol import Engine, SamplingSettings
from rlrun.engines.native.engine import NativeEngine
from rlrun.models.loading import load_tokenizer, response_end_ids

CPU = torch.device("cpu")
CAP = 24


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen_vocab")
    save_qwen_vocab_model(folder, end_bias={ENDOFTEXT: 14.0})
    bare = tmp_path_factory.mktemp("qwen_vocab_no_gen_config")
    save_qwen_vocab_model(bare, end_bias={ENDOFTEXT: 14.0}, generation_config=False)
    return folder, bare


def _prompts(tokenizer) -> list[list[int]]:
    """Six GSM8K test questions, as verl's parquet holds them, through Qwen's chat template."""
    rows = released("gsm8k", "test")[:6]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["question"] + " " + GSM8K_INSTRUCTION}],
                                           tokenize=False, add_generation_prompt=True) for r in rows]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _engine(kind: str, folder, end_ids: tuple[int, ...]) -> tuple[Engine, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(PretrainedConfig(pretrain=str(folder)))
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    settings = SamplingSettings(1.0, 1.0, CAP, int(tokenizer.pad_token_id), end_ids)
    engine = NativeEngine(model, settings, CPU, tokenizer) if kind == "native" else HFEngine(model, settings, CPU,
                                                                                          tokenizer)
    return engine, _prompts(tokenizer)


def test_end_ids_are_the_tokenizers_eos_then_the_generation_configs(qwen):
    folder, bare = qwen
    tokenizer = load_tokenizer(PretrainedConfig(pretrain=str(folder)))
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert len(tokenizer) == 151_669
    assert response_end_ids(PretrainedConfig(pretrain=str(folder)), tokenizer) == (IM_END, ENDOFTEXT)
    assert response_end_ids(PretrainedConfig(pretrain=str(bare)), tokenizer) == (IM_END,)
    assert response_end_ids(PretrainedConfig(pretrain=None), load_tokenizer(PretrainedConfig())) == (258,)


def test_a_bad_generation_config_names_the_file(qwen, tmp_path):
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(qwen[1], folder)
    (folder / "generation_config.json").write_text('{"eos_token_id": "<|im_end|>"}')
    tokenizer = load_tokenizer(PretrainedConfig(pretrain=str(folder)))
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id must be a token id or a list of "
                                         r"them, not '<\|im_end\|>'"):
        response_end_ids(PretrainedConfig(pretrain=str(folder)), tokenizer)


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_every_listed_id_ends_a_response_and_nothing_runs_past_one(qwen, kind):
    folder, _ = qwen
    engine, prompts = _engine(kind, folder, (IM_END, ENDOFTEXT))
    responses = engine.sample(prompts * 2, seed=11).responses
    ended = 0
    for row in responses:
        assert 1 <= len(row) <= CAP
        assert not any(t in (IM_END, ENDOFTEXT) for t in row[:-1]), row  # no response runs past an end
        ended += row[-1] in (IM_END, ENDOFTEXT)
        assert row[-1] in (IM_END, ENDOFTEXT) or len(row) == CAP
    assert ended >= len(responses) // 2, responses  # the head favours <|endoftext|>: most rows end early


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_an_unlisted_id_does_not_end_a_response(qwen, kind):
    """Only the tokenizer's eos listed (a model folder without generation_config.json): `<|endoftext|>` is an
    ordinary token, sampled and passed, as vLLM would do for that folder."""
    _, bare = qwen
    engine, prompts = _engine(kind, bare, (IM_END,))
    responses = engine.sample(prompts, seed=11).responses
    assert any(ENDOFTEXT in row[:-1] for row in responses)
    for row in responses:
        assert row[-1] == IM_END or len(row) == CAP
