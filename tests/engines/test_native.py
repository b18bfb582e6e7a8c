"""rlrun's native decoder engine against the HF model it decodes: real tiny HF models of every supported architecture
(built from a config), the real byte tokenizer, HF's own forward, generate and logits warpers as references."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from rlrun.engines.build import resolve_backend
from rlrun.engines.protocol import SamplingSettings
from rlrun.engines.native.decoder import fused_groups, unsupported_reason
from rlrun.engines.native.engine import NativeEngine
from rlrun.engines.native.engine import processed_log_probs
from rlrun.engines.receivers import bucket_size, entry_view, pack_buckets
from rlrun.models.tiny import BYTE_VOCAB_SIZE, EOS_ID, PAD_ID, build_byte_tokenizer, build_causal_lm
from rlrun.runtime.errors import ConfigError

TOK = build_byte_tokenizer()
CPU = torch.device("cpu")
_COMMON = dict(vocab_size=BYTE_VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               max_position_embeddings=256, pad_token_id=PAD_ID, eos_token_id=EOS_ID, bos_token_id=PAD_ID + 1)
ARCHS = {
    # grouped-query attention, q/k/v biases (Qwen2's default), separate head
    "qwen2": lambda: Qwen2Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    # multi-head attention, attention and MLP biases, tied embeddings
    "llama": lambda: LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=4, attention_bias=True,
                                 mlp_bias=True, tie_word_embeddings=True),
    # per-head q/k norms, a head_dim that is not hidden / heads
    "qwen3": lambda: Qwen3Config(**_COMMON, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                 tie_word_embeddings=False),
    # a sliding window longer than any sequence here, rope theta of its own
    "mistral": lambda: MistralConfig(**_COMMON, num_attention_heads=2, num_key_value_heads=1, sliding_window=4096,
                                     rope_theta=1000.0),
}
PROMPTS = [list(range(40, 40 + n)) for n in (3, 11, 6, 1, 17, 9, 4, 13)]


def _model(arch: str, seed: int = 0) -> torch.nn.Module:
    model = build_causal_lm(ARCHS[arch](), seed=seed).eval()
    with torch.no_grad():  # random init makes every logit ~0: sharpen them so EOS and repeats really happen
        model.model.norm.weight.mul_(4.0)
    return model


def _engine(model: torch.nn.Module, temperature: float = 0.7, top_p: float = 1.0, new: int = 24,
            eos: int = EOS_ID) -> NativeEngine:
    return NativeEngine(model, SamplingSettings(temperature, top_p, new, PAD_ID, (eos,)), CPU, TOK)


def _hf_log_probs(model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log p(response token | prefix) under logits / temperature, from one HF forward of the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_sampled_log_probs_are_the_hf_model_s(arch: str) -> None:
    """Every sampled token's log-prob equals HF's forward over prompt + response: the cache, the positions under
    left padding and the dropping of finished rows all line up. A frequent token plays EOS so rows end at
    different steps (dropping them from the batch mid-way)."""
    model = _model(arch)
    probe = _engine(model).sample(PROMPTS, seed=1)
    candidates = sorted(set(t for r in probe.responses for t in r), key=lambda t: -sum(t in r for r in probe.responses))
    for eos in candidates[:10]:  # the first frequent token that, as EOS, ends rows at several different steps
        out = _engine(model, eos=eos).sample(PROMPTS, seed=1)
        lengths = [len(r) for r in out.responses]
        if any(r[-1] == eos for r in out.responses) and len(set(lengths)) > 2:
            break
    else:
        pytest.fail(f"no frequent token ends rows at different steps: {probe.responses}")
    assert all(eos not in r[:-1] for r in out.responses)
    for prompt, response, lps in zip(PROMPTS, out.responses, out.log_probs):
        assert len(lps) == len(response)
        torch.testing.assert_close(torch.tensor(lps), _hf_log_probs(model, prompt, response, 0.7), rtol=0, atol=2e-5)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_equals_hf_generate(arch: str) -> None:
    """top_p -> 0 keeps only the most likely token: the native engine's greedy continuation is HF generate's."""
    model = _model(arch)
    out = _engine(model, temperature=1.0, top_p=1e-9, new=16, eos=10**6).sample(PROMPTS, seed=0)
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        want = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16,
                              min_new_tokens=16, pad_token_id=PAD_ID, eos_token_id=10**6)[:, width:]
    assert out.responses == want.tolist()
    assert all(abs(x) < 1e-6 for row in out.log_probs for x in row)  # the only token left has probability 1


def test_same_seed_same_samples_and_the_global_rng_is_untouched() -> None:
    engine = _engine(_model("qwen2"))
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = engine.sample(PROMPTS, seed=5)
    after = torch.rand(3)
    assert torch.equal(before, after)
    assert engine.sample(PROMPTS, seed=5) == a
    assert engine.sample(PROMPTS, seed=6).responses != a.responses


def test_processed_log_probs_match_hf_warpers() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_p in ((1.0, 1.0), (0.7, 1.0), (1.3, 0.9), (0.5, 0.3), (1.0, 1e-9)):
        scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_p < 1.0:
            scores = TopPLogitsWarper(top_p)(None, scores)
        want = torch.log_softmax(scores, -1)
        got = processed_log_probs(logits, temperature, top_p)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), (temperature, top_p)
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=0, atol=1e-5)


def test_the_decoder_runs_on_the_hf_parameters_memory_and_sees_every_write() -> None:
    """The decoder holds no weight of its own: its joined q/k/v and gate/up projections are the HF parameters'
    memory (laid out back to back at start), so an in-place write (colocated weight sync) is what the next call
    samples from with nothing copied. A parameter re-pointed to a storage of its own (the disaggregated receive
    buffers when not laid out back to back) is still seen: that call joins a copy."""
    model = _model("qwen2")
    engine = _engine(model)
    attention = model.model.layers[0].self_attn
    q, k, v = attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight
    assert q.data_ptr() + q.nbytes == k.data_ptr() and k.data_ptr() + k.nbytes == v.data_ptr()
    with engine.decoder.weights() as copied:
        assert copied == 0
        assert engine.decoder.layers[0].qkv_weight.data_ptr() == q.data_ptr()
        assert engine.decoder.layers[1].gate_up.data_ptr() == model.model.layers[1].mlp.gate_proj.weight.data_ptr()
    new = _model("qwen2", seed=9)
    with torch.no_grad():
        for p, fresh in zip(model.parameters(), new.parameters()):
            p.copy_(fresh)
    out = engine.sample(PROMPTS[:3], seed=2)
    for prompt, response, lps in zip(PROMPTS, out.responses, out.log_probs):
        torch.testing.assert_close(torch.tensor(lps), _hf_log_probs(new, prompt, response, 0.7), rtol=0, atol=2e-5)
    newer = _model("qwen2", seed=11)
    with torch.no_grad():
        for (name, p), fresh in zip(model.named_parameters(), newer.parameters()):
            if name.endswith("k_proj.weight"):
                p.data = fresh.detach().clone()  # a storage of its own: no longer back to back with q and v
            else:
                p.copy_(fresh)
    with engine.decoder.weights() as copied:
        assert copied == 2  # the k_proj groups of both layers
    out = engine.sample(PROMPTS[:3], seed=2)
    for prompt, response, lps in zip(PROMPTS, out.responses, out.log_probs):
        torch.testing.assert_close(torch.tensor(lps), _hf_log_probs(newer, prompt, response, 0.7), rtol=0, atol=2e-5)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_weight_sync_buckets_planned_with_fused_groups_are_what_the_decoder_runs_on(arch: str) -> None:
    """The disaggregated engine's parameters are views into weight sync's receive buffers. Planned with
    fused_groups (what rlrun.rl.assembly passes), each layer's q/k/v weights (and biases) and gate/up land back to
    back: the decoder joins them without a copy, and samples as the HF model does."""
    model = _model(arch)
    engine = _engine(model)
    names = [n for n, _ in model.named_parameters()]
    groups = fused_groups(names)
    layers = model.config.num_hidden_layers
    biases = {"qwen2": 1, "llama": 2}.get(arch, 0)  # Qwen2: q/k/v biases; this Llama: MLP biases too
    assert len(groups) == layers * (2 + biases)
    params = dict(model.named_parameters())
    buckets = pack_buckets([(n, p.shape, p.dtype) for n, p in params.items()], 4096, groups)
    with torch.no_grad():
        for bucket in buckets:  # as WeightSync binds an engine: each parameter becomes a view into its bucket
            buffer = torch.empty(bucket_size(bucket), dtype=torch.uint8)
            for e in bucket:
                view = entry_view(buffer, e)
                view.copy_(params[e.name])
                params[e.name].data = view
    with engine.decoder.weights() as copied:
        assert copied == 0
    out = engine.sample(PROMPTS[:4], seed=5)
    for prompt, response, lps in zip(PROMPTS, out.responses, out.log_probs):
        torch.testing.assert_close(torch.tensor(lps), _hf_log_probs(model, prompt, response, 0.7), rtol=0, atol=2e-5)


def test_stop_strings_end_each_row_at_the_completing_token() -> None:
    engine = _engine(_model("qwen2"), temperature=1.0, eos=10**6)
    stop = ("a", "e", "o")
    out = engine.sample([TOK.encode(t, add_special_tokens=False) for t in ("hello", "x", "say:", "q")] * 4, seed=3,
                        stop=stop, max_new_tokens=40)
    stopped = 0
    for row, lps in zip(out.responses, out.log_probs):
        assert 1 <= len(row) <= 40 and len(lps) == len(row)
        assert not any(s in TOK.decode(row[:-1]) for s in stop)  # nothing before the last token completes a stop
        hit = any(s in TOK.decode(row) for s in stop)
        stopped += hit
        assert hit or len(row) == 40
    assert stopped >= 4


def test_architectures_it_cannot_run_are_named() -> None:
    assert unsupported_reason(ARCHS["qwen2"](), 512) is None
    assert "gpt2" in unsupported_reason(GPT2Config(), 64)
    windowed = Qwen2Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True,
                           sliding_window=32)
    assert "sliding_window 32" in unsupported_reason(windowed, 64)
    assert unsupported_reason(windowed, 32) is None
    blocker = unsupported_reason(GPT2Config(), 64)
    assert resolve_backend("auto", cuda=False, native_blocker=blocker) == (
        "hf", f"auto: the native engine cannot run this policy ({blocker})")
    assert resolve_backend("auto", cuda=False)[0] == "native"
    with pytest.raises(ConfigError, match="--generation_backend native cannot run this policy: model type 'gpt2'"):
        resolve_backend("native", cuda=False, native_blocker=blocker)
