"""Turn ends at stop strings, on the real byte tokenizer and the real HF engine (tiny model)."""

from __future__ import annotations

import torch

from rlrun.engines.hf import HFEngine
from rlrun.engines.protocol import SamplingSettings
from rlrun.engines.protocol import cut_at_stop
from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config

TOK = build_byte_tokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def test_cut_keeps_the_token_completing_the_first_stop_string() -> None:
    tokens = ids("go <search>cats</search> and <answer>x</answer>")
    cut = cut_at_stop(tokens, ("</search>", "</answer>"), TOK)
    assert TOK.decode(cut) == "go <search>cats</search>"
    assert cut == tokens[:len(ids("go <search>cats</search>"))]  # the sampled ids, never re-tokenised


def test_cut_without_a_stop_string_or_stops_is_identity() -> None:
    tokens = ids("no tags here")
    assert cut_at_stop(tokens, ("</search>",), TOK) == tokens
    assert cut_at_stop(tokens, (), TOK) == tokens
    assert cut_at_stop([], ("</search>",), TOK) == []


def test_hf_engine_stops_each_row_at_its_stop_string() -> None:
    """Real generate with stop_strings; whatever the tiny model samples, no row runs past a stop string
    and rows without one are only cut by EOS or the cap."""
    model = build_causal_lm(tiny_model_config(), seed=0)
    sampling = SamplingSettings(temperature=1.0, top_p=1.0, max_new_tokens=24, pad_id=TOK.pad_token_id,
                                end_ids=(TOK.eos_token_id,))
    engine = HFEngine(model, sampling, torch.device("cpu"), TOK)
    stop = ("a", "e")  # frequent single bytes, so most rows stop early
    out = engine.sample([ids("hello"), ids("x")] * 4, seed=3, stop=stop, max_new_tokens=12)
    assert len(out.responses) == 8
    stopped = 0
    for row in out.responses:
        assert 1 <= len(row) <= 12
        text = TOK.decode(row[:-1])
        assert not any(s in text for s in stop), text  # nothing before the last token completes a stop
        stopped += any(s in TOK.decode(row) for s in stop)
    assert stopped >= 1
