"""The native engine's decode step: its attention keeps scores in fp32 under a bf16 model, and the static-shape step
a CUDA graph captures (step_mode "static": the same step run without capture, on the CPU here) reports the HF
model's log-probs and decodes what the default step decodes. The capture itself needs a GPU:
bench/gpu/harness.py's native_cuda_graph check compares captured and uncaptured tokens there."""

from __future__ import annotations

import copy

import pytest
import torch

from rlrun.engines.protocol import SamplingSettings
from rlrun.engines.native.decoder import decode_attention
from rlrun.engines.native.engine import NativeEngine
from rlrun.models.tiny import PAD_ID
from test_native import ARCHS, PROMPTS, TOK, _hf_log_probs, _model  # tests/engines/test_native.py's tiny models

CPU = torch.device("cpu")


def _engine(model: torch.nn.Module, mode: str, temperature: float = 0.7, top_p: float = 1.0, new: int = 24,
            eos: int = 10**6) -> NativeEngine:
    engine = NativeEngine(model, SamplingSettings(temperature, top_p, new, PAD_ID, (eos,)), CPU, TOK)
    engine.step_mode = mode
    return engine


def test_decode_attention_keeps_bf16_scores_in_fp32() -> None:
    """bf16 queries/keys/values with scores up to ~40 (as real models' attention logits reach): the output is the
    fp32 computation's up to the bf16 roundings of the probabilities and the output; scores rounded to bf16 first
    (the decoder before, and HF's eager attention) miss it by ~7x more."""
    g = torch.Generator().manual_seed(0)
    N, G, T, D = 16, 4, 200, 64
    q = (torch.randn(N, G, D, generator=g) * 8 / D ** 0.25).bfloat16()
    k = (torch.randn(N, T, D, generator=g) * 8 / D ** 0.25).bfloat16()
    v = torch.randn(N, T, D, generator=g).bfloat16()
    bias = torch.zeros(N, 1, T)
    bias[::2, :, :50] = float("-inf")  # left padding on every other row
    scale = D ** -0.5
    scores = torch.baddbmm(bias, q.float(), k.float().transpose(1, 2), alpha=scale)
    assert scores[scores.isfinite()].abs().max() > 20
    want = torch.softmax(scores, -1) @ v.float()
    got = decode_attention(q, k, v, bias, scale)
    assert got.dtype == torch.bfloat16
    rounded = torch.baddbmm(bias.bfloat16(), q, k.transpose(1, 2), alpha=scale)  # bf16 scores
    before = torch.bmm(torch.softmax(rounded, -1, dtype=torch.float32).bfloat16(), v).float()
    assert (got.float() - want).abs().max() < 0.03
    assert (before - want).abs().max() > 0.05


@pytest.mark.parametrize("arch", list(ARCHS))
def test_bf16_engine_log_probs_are_close_to_the_hf_forward(arch: str) -> None:
    """A bf16 model: the engine's log-probs against HF's (SDPA) forward of the same bf16 model. The two round
    differently (fused projections, another attention kernel), so close, not equal: over seeds 0-7 the mean
    difference was 0.002-0.016 and the largest 0.015-0.12 (bf16 keeps 8 bits of these tiny models' logits, which
    reach 30); the bounds leave twice that, and a wrong position or cache misses them by far."""
    model = copy.deepcopy(_model(arch)).to(torch.bfloat16)
    out = _engine(model, "eager", temperature=1.0).sample(PROMPTS, seed=1)
    gaps = torch.cat([(torch.tensor(lps) - _hf_log_probs(model, prompt, response, 1.0)).abs()
                      for prompt, response, lps in zip(PROMPTS, out.responses, out.log_probs)])
    assert float(gaps.mean()) < 0.03 and float(gaps.max()) < 0.25, (float(gaps.mean()), float(gaps.max()))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_static_step_log_probs_are_the_hf_model_s(arch: str) -> None:
    """The static step (whole-capacity attention over a zeroed cache, writes at a device-held position, rows
    dropped at GRAPH_COMPACT_FRACTION and the step rebuilt) reports HF's teacher-forced log-probs, rows ending at
    different steps."""
    model = _model(arch)
    probe = _engine(model, "eager").sample(PROMPTS, seed=1)
    counts: dict[int, int] = {}
    for r in probe.responses:
        for t in set(r):
            counts[t] = counts.get(t, 0) + 1
    for eos in sorted(counts, key=lambda t: -counts[t])[:10]:
        out = _engine(model, "static", eos=eos).sample(PROMPTS, seed=1)
        if len({len(r) for r in out.responses}) > 2:
            break
    else:
        pytest.fail("no frequent token ends rows at different steps")
    for prompt, response, lps in zip(PROMPTS, out.responses, out.log_probs):
        assert len(lps) == len(response)
        torch.testing.assert_close(torch.tensor(lps), _hf_log_probs(model, prompt, response, 0.7), rtol=0, atol=2e-5)


def test_static_step_decodes_what_the_default_step_decodes() -> None:
    """fp32: greedy and sampled continuations of the static step are the default step's (same seed)."""
    model = _model("qwen2")
    for temperature, top_p in ((1.0, 1e-9), (0.7, 1.0)):
        eager = _engine(model, "eager", temperature, top_p).sample(PROMPTS, seed=3)
        static = _engine(model, "static", temperature, top_p).sample(PROMPTS, seed=3)
        assert static.responses == eager.responses
        torch.testing.assert_close(torch.tensor(static.log_probs), torch.tensor(eager.log_probs), rtol=0, atol=1e-5)


def test_bucketed_static_step_attends_over_its_span_and_decodes_what_the_default_step_decodes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The captured step's span (decode_bucket): each step attends over the filled positions rounded up to a
    multiple of the bucket, never the whole capacity; one span built per bucket reached, again after rows are
    dropped; sampled tokens and log-probs those of the whole-capacity static step (the same kernels over more
    masked positions), greedy ones the default step's. (Sampled tokens are not compared with the default step: its
    attention sums over other lengths, ~1e-6 off, and a draw that close to a boundary takes another token.)"""
    import rlrun.engines.native.decoder as decoder_module

    seen: list[int] = []
    real = decoder_module.decode_attention

    def recording(q, keys, values, bias, scale):
        seen.append(keys.shape[1])
        return real(q, keys, values, bias, scale)

    model = _model("qwen2")
    new, bucket = 24, 5
    whole = _engine(model, "static", new=new).sample(PROMPTS, seed=5)
    engine = _engine(model, "static", new=new)
    engine.decode_bucket = bucket
    monkeypatch.setattr(decoder_module, "decode_attention", recording)
    bucketed = engine.sample(PROMPTS, seed=5)
    monkeypatch.undo()
    assert bucketed.responses == whole.responses
    torch.testing.assert_close(torch.tensor(bucketed.log_probs), torch.tensor(whole.log_probs), rtol=0, atol=1e-5)
    greedy = _engine(model, "static", top_p=1e-9, new=new)
    greedy.decode_bucket = bucket
    eager = _engine(model, "eager", top_p=1e-9, new=new).sample(PROMPTS, seed=5)
    assert greedy.sample(PROMPTS, seed=5).responses == eager.responses
    capacity = max(len(p) for p in PROMPTS) + new
    spans = sorted(set(seen))
    assert all(s % bucket == 0 or s == capacity for s in spans), spans
    assert min(spans) < capacity - bucket, spans  # early steps read far less than the capacity
    assert engine.last_spans_built >= len(spans) and engine.last_steps_built >= 1


def test_static_step_reads_no_unwritten_cache_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The static step attends over the whole capacity: positions not written yet must be zeros, not what the
    memory held (NaN there would survive the mask as NaN * 0). Fresh caches here come out of NaN-filled memory."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    model = _model("llama")
    want = _engine(model, "eager").sample(PROMPTS, seed=2)
    monkeypatch.setattr(torch, "empty", nan_empty)
    got = _engine(model, "static").sample(PROMPTS, seed=2)
    assert got.responses == want.responses


def test_cuda_graph_off_cuda_says_so_once_and_decodes_as_without(capsys: pytest.CaptureFixture[str]) -> None:
    model = _model("qwen2")
    settings = SamplingSettings(0.7, 1.0, 16, PAD_ID, (10**6,))
    engine = NativeEngine(model, settings, CPU, TOK, cuda_graph=True)
    assert engine.step_mode == "eager"
    assert capsys.readouterr().out.count("CUDA graphs need a CUDA device") == 1
    plain = NativeEngine(model, settings, CPU, TOK)
    assert engine.sample(PROMPTS, seed=4) == plain.sample(PROMPTS, seed=4)
