"""The native engine within a KV-cache budget: as many rows at once as it holds, each queued prompt prefilled into a
finished row's place (continuous batching over a ring of cache columns), results in the prompts' order, today's
the same samples under every budget, a clear error for a row that cannot fit alone. Every row's log-probs are
checked against HF's teacher-forced ones for its own prompt, so a row that read another's keys or a stale column
fails."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlrun.engines.protocol import SamplingSettings
from rlrun.engines.native.engine import GPU_FREE_FRACTION, NativeEngine
from rlrun.models.tiny import EOS_ID, PAD_ID
from rlrun.runtime.errors import ConfigError
from test_native import ARCHS, PROMPTS, TOK, _hf_log_probs, _model  # tests/engines/test_native.py's tiny models

CPU = torch.device("cpu")
NEW = 24
WIDTH = max(map(len, PROMPTS))
SAME_LENGTH = [list(range(40 + i, 50 + i)) for i in range(7)]  # 7 distinct prompts of 10 tokens


def _engine(model: torch.nn.Module, kv_cache_bytes: int | None, temperature: float = 0.7,
            eos: int = EOS_ID) -> NativeEngine:
    return NativeEngine(model, SamplingSettings(temperature, 1.0, NEW, PAD_ID, (eos,)), CPU, TOK,
                        kv_cache_bytes=kv_cache_bytes)


def _assert_hf_log_probs(model: torch.nn.Module, prompts: list[list[int]], out, temperature: float = 0.7) -> None:
    """Each row's log-probs are HF's teacher-forced ones for *its own* prompt: a row landing at another prompt's
    index (or a batch decoded with a stale cache or wrong positions) fails."""
    for prompt, response, lps in zip(prompts, out.responses, out.log_probs):
        assert len(response) >= 1 and len(lps) == len(response)
        torch.testing.assert_close(torch.tensor(lps), _hf_log_probs(model, prompt, response, temperature),
                                   rtol=0, atol=2e-5)


@pytest.mark.parametrize("k", [1, 2, 3, 7])
def test_a_budget_of_k_rows_decodes_k_at_once_and_the_rest_in_finished_rows_places(k: int) -> None:
    model = _model("qwen2")
    engine = _engine(model, None)
    engine.kv_cache_bytes = k * engine.kv_row_bytes(10, NEW)
    out = engine.sample(SAME_LENGTH, seed=4)
    assert (engine.last_batches, engine.last_admitted) == (1, len(SAME_LENGTH) - k)
    _assert_hf_log_probs(model, SAME_LENGTH, out)


def test_a_one_row_budget_at_the_longest_prompt_decodes_one_row_at_a_time() -> None:
    """Eight rows through one cache row: the ring of WIDTH + NEW columns wraps several times."""
    model = _model("qwen2")
    engine = _engine(model, None)
    engine.kv_cache_bytes = engine.kv_row_bytes(WIDTH, NEW)
    out = engine.sample(PROMPTS, seed=1)
    assert engine.last_admitted == len(PROMPTS) - 1
    _assert_hf_log_probs(model, PROMPTS, out)


@pytest.mark.parametrize("prompts", [PROMPTS, [list(range(40, 100))] + [[41, 42]] * 7], ids=["mixed", "one_long"])
def test_batches_go_longest_first_each_within_the_budget_at_its_own_width(prompts: list[list[int]]) -> None:
    """The batches decoded one after another when routing is recorded (R3 follows each batch row in order)."""
    model = _model("qwen2")
    engine = _engine(model, None)
    width = max(map(len, prompts))
    budget = engine.kv_cache_bytes = 2 * engine.kv_row_bytes(width, NEW)
    batches = engine._batches(prompts, NEW)
    assert sorted(i for b in batches for i in b) == list(range(len(prompts)))
    order = [len(prompts[i]) for b in batches for i in b]
    assert order == sorted(order, reverse=True)
    for batch in batches:
        assert len(batch) * engine.kv_row_bytes(max(len(prompts[i]) for i in batch), NEW) <= budget
    if len(prompts[0]) == 60:  # one long prompt: the short ones share a batch of six, not three batches of two
        assert [len(b) for b in batches] == [2, 6]
        out = engine.sample(prompts, seed=0)  # two rows at the long prompt's width, six prompts after them
        assert (engine.last_batches, engine.last_admitted) == (1, 6)
        _assert_hf_log_probs(model, prompts, out)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_every_budget_gives_the_same_samples(arch: str) -> None:
    """Issue 64: the draws were one generator's, handed out in the order the rows asked, so a row's tokens followed
    the budget (on a GPU, the memory free at the call): the same seed gave other rollouts on another card or after a
    resume. Now a row's draws are its own: one row at a time, two, three, or all at once (continuous batching, ring
    wraps) all sample the same tokens (MoE's batches one after another: tests/models/test_moe.py). Log-probs equal to
    float rounding (a row's logits come from batches of other sizes)."""
    model = _model(arch)
    unbounded = _engine(model, None).sample(PROMPTS, seed=7)  # CPU without a budget: one batch
    row = _engine(model, None).kv_row_bytes(WIDTH, NEW)
    for rows in (1, 2, 3, len(PROMPTS)):
        engine = _engine(model, rows * row)
        got = engine.sample(PROMPTS, seed=7)
        assert engine.last_admitted == len(PROMPTS) - rows
        assert got.responses == unbounded.responses, rows
        torch.testing.assert_close(torch.tensor(sum(got.log_probs, [])), torch.tensor(sum(unbounded.log_probs, [])),
                                   rtol=0, atol=1e-5)


def test_a_small_budget_is_deterministic_and_every_row_is_the_model_s() -> None:
    model = _model("llama")
    engine = _engine(model, 2 * _engine(model, None).kv_row_bytes(WIDTH, NEW))
    a = engine.sample(PROMPTS, seed=5)
    assert engine.last_admitted == len(PROMPTS) - 2
    assert engine.sample(PROMPTS, seed=5) == a
    assert engine.sample(PROMPTS, seed=6).responses != a.responses
    assert _engine(model, engine.kv_cache_bytes).sample(PROMPTS, seed=5) == a  # a fresh engine: the same samples
    _assert_hf_log_probs(model, PROMPTS, a)


def test_stop_strings_end_rows_in_every_batch() -> None:
    model = _model("qwen2")
    prompts = [TOK.encode(t, add_special_tokens=False) for t in ("hello", "x", "say:", "q")] * 4
    engine = _engine(model, None, temperature=1.0, eos=10**6)
    engine.kv_cache_bytes = 3 * engine.kv_row_bytes(max(map(len, prompts)), 40)
    stop = ("a", "e", "o")
    out = engine.sample(prompts, seed=3, stop=stop, max_new_tokens=40)
    assert engine.last_admitted == len(prompts) - 3
    stopped = 0
    for row in out.responses:
        assert 1 <= len(row) <= 40
        assert not any(s in TOK.decode(row[:-1]) for s in stop)  # nothing before the last token completes a stop
        hit = any(s in TOK.decode(row) for s in stop)
        stopped += hit
        assert hit or len(row) == 40
    assert stopped >= 4
    _assert_hf_log_probs(model, prompts, out, temperature=1.0)


def test_a_prompt_too_long_for_the_budget_is_named() -> None:
    engine = _engine(_model("qwen2"), None)
    need = engine.kv_row_bytes(WIDTH, NEW)
    engine.kv_cache_bytes = need - 1  # holds every shorter prompt's row, not the longest one's
    with pytest.raises(ValueError, match=rf"needs {need} bytes .* budget of {need - 1} bytes .*--native_kv_cache_mb"):
        engine.sample(PROMPTS, seed=0)  # a ConfigError: a ValueError that rlrun reports as one line
    with pytest.raises(ConfigError, match="must be > 0 bytes"):
        _engine(_model("qwen2"), 0)


def test_the_gpu_default_fits_the_rows_the_free_memory_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """On GPU without a budget, the batches fit GPU_FREE_FRACTION of the free memory (the driver's free memory
    plus what this process's allocator holds unused) at each row's estimated peak; too little is a named error."""
    engine = _engine(_model("qwen2"), None)
    engine.device = torch.device("cuda")  # _batches only: nothing is allocated there
    peak = engine.peak_row_bytes(WIDTH, NEW)
    free = {"driver": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["driver"], 10**12))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * peak)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 * peak)
    free["driver"] = math.ceil(3 * peak / GPU_FREE_FRACTION) - peak  # with the allocator's spare row: three rows
    batches = engine._batches(PROMPTS, NEW)
    assert len(batches[0]) == 3 and sum(map(len, batches)) == len(PROMPTS)
    free["driver"] = math.ceil(8 * peak / GPU_FREE_FRACTION)
    assert engine._batches(PROMPTS, NEW) == [list(range(len(PROMPTS)))]  # all eight in order: today's one batch
    free["driver"] = 0
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * peak + 100)
    with pytest.raises(ConfigError, match=r"GPU memory free now .*--native_kv_cache_mb"):
        engine._batches(PROMPTS, NEW)


def test_the_peak_estimate_covers_the_measured_prefill() -> None:
    """Qwen2.5-0.5B's shape in bf16 (built on the meta device): the [16, 2048] prefill peaked at 1.94 GiB on an
    H200 (bench/gpu prefill_memory), the cache included. The estimate must not be below that, nor far above."""
    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=32768)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    engine = NativeEngine(model, SamplingSettings(1.0, 1.0, 0, 0, (1,)), torch.device("meta"))
    assert engine.kv_row_bytes(2048, 0) == 24 * 2 * 2 * 64 * 2 * 2048
    estimate = 16 * engine.peak_row_bytes(2048, 0) / 2**30
    assert 1.94 <= estimate <= 1.5 * 1.94, estimate


def test_other_architectures_batch_alike() -> None:
    """GQA with q/k norms (qwen3) and a single KV head (mistral): the row bytes follow each decoder's cache layout."""
    for arch in ("qwen3", "mistral"):
        model = _model(arch)
        engine = _engine(model, None)
        cfg = ARCHS[arch]()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        assert engine.kv_row_bytes(WIDTH, NEW) == (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4
                                                   * (WIDTH + NEW))
        engine.kv_cache_bytes = 3 * engine.kv_row_bytes(WIDTH, NEW)
        out = engine.sample(PROMPTS, seed=2)
        assert engine.last_admitted == len(PROMPTS) - 3
        _assert_hf_log_probs(model, PROMPTS, out)


def test_the_captured_step_s_reference_admits_rows_over_its_spans_and_the_wrapped_ring() -> None:
    """step_mode "static" (what a CUDA graph captures, uncaptured on CPU) with spans of 8 columns: the pool's ring
    wraps, after which every step attends over the whole capacity, and every row is still its own prompt's."""
    model = _model("qwen2")
    engine = NativeEngine(model, SamplingSettings(0.7, 1.0, NEW, PAD_ID, (EOS_ID,)), CPU, TOK, decode_bucket=8)
    engine.step_mode = "static"
    engine.kv_cache_bytes = 2 * engine.kv_row_bytes(WIDTH, NEW)
    out = engine.sample(PROMPTS, seed=3)
    assert engine.last_admitted == len(PROMPTS) - 2 and engine.last_spans_built > 1
    _assert_hf_log_probs(model, PROMPTS, out)


def test_sample_until_stops_with_queued_rows_unstarted() -> None:
    """--partial_rollout's call under a two-row budget: it stops once `need` groups are complete; the prompts still
    waiting come back empty and unfinished (continued later), the rest are the model's."""
    model = _model("qwen2")
    engine = _engine(model, None)
    engine.kv_cache_bytes = 2 * engine.kv_row_bytes(WIDTH, NEW)
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    out, finished = engine.sample_until(PROMPTS, 5, [NEW] * 8, groups, need=1)
    assert finished[:2] == [True, True] and not all(finished)  # the first group was decoded first, in the first rows
    assert any(response == [] and not f for response, f in zip(out.responses, finished))
    started = [i for i, response in enumerate(out.responses) if response]
    for i in started:
        assert finished[i] or len(out.responses[i]) < NEW
        torch.testing.assert_close(torch.tensor(out.log_probs[i]),
                                   _hf_log_probs(model, PROMPTS[i], out.responses[i], 0.7), rtol=0, atol=2e-5)
    every, finished = engine.sample_until(PROMPTS, 5, [NEW] * 8, groups, need=4)
    assert all(finished) and engine.last_admitted == 6
    _assert_hf_log_probs(model, PROMPTS, every)
