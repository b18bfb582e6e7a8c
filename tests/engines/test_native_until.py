"""NativeEngine.sample_until (--partial_rollout's decode): stop once enough groups finished, keep what the running rows
have. The real tiny model with long-tailed lengths (helpers.save_long_tailed_base), the real byte tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlrun.engines.protocol import SamplingSettings
from rlrun.engines.native.engine import NativeEngine
from rlrun.models.tiny import BUILTIN_PROMPTS, EOS_ID, PAD_ID, build_byte_tokenizer

from helpers import save_long_tailed_base

TOK = build_byte_tokenizer()
PROMPTS = [TOK.encode(r["prompt"]) for r in BUILTIN_PROMPTS[:12]]
GROUPS = [i // 3 for i in range(12)]  # 4 groups of 3 rows
CAP = 40


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> NativeEngine:
    model = AutoModelForCausalLM.from_pretrained(save_long_tailed_base(tmp_path_factory.mktemp("long_tailed")))
    return NativeEngine(model, SamplingSettings(1.0, 1.0, CAP, PAD_ID, (EOS_ID,)), torch.device("cpu"), TOK)


def test_until_every_group_is_sample(engine):
    """Asked for every group, it decodes what sample() decodes, draw for draw; every row is finished."""
    full = engine.sample(PROMPTS, seed=3)
    out, finished = engine.sample_until(PROMPTS, 3, [CAP] * 12, GROUPS, need=4)
    assert out.responses == full.responses and out.log_probs == full.log_probs and all(finished)
    lengths = sorted(len(r) for r in full.responses)
    assert lengths[0] < CAP // 2 and lengths[-1] == CAP, lengths  # the workload really is long-tailed


def test_stops_when_enough_groups_finished(engine):
    full = engine.sample(PROMPTS, seed=3)
    out, finished = engine.sample_until(PROMPTS, 3, [CAP] * 12, list(range(12)), need=1)  # groups of one row
    assert any(finished) and not all(finished)
    stopped_at = max(len(r) for r in out.responses)
    for row, (got, want, done) in enumerate(zip(out.responses, full.responses, finished)):
        if done:  # a finished row is the full decode's row: EOS, or its cap
            assert got == want
        else:  # a running row kept every token it had when the decode stopped: a prefix of the full decode
            assert got == want[:stopped_at] and len(got) == stopped_at and EOS_ID not in got, row
            assert out.log_probs[row] == full.log_probs[row][:stopped_at]
    assert stopped_at < max(len(r) for r in full.responses)


def test_each_row_stops_at_its_own_limit(engine):
    limits = [3 if i % 2 else CAP for i in range(12)]
    out, finished = engine.sample_until(PROMPTS, 3, limits, GROUPS, need=4)
    assert all(finished)
    assert all(len(r) <= 3 for r in out.responses[1::2]) and max(len(r) for r in out.responses[::2]) > 3
