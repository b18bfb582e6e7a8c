"""Chunked vocab projection (rlrun.algo.vocab_chunks): the log-probs, entropy and gradients of the full
`log_softmax(linear(h, W, b).float() / T)`, without ever creating an [N, V] tensor."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlrun.algo.losses import entropy_from_logits, log_probs_from_logits
from rlrun.algo.vocab_chunks import chunked_log_probs


def full(hidden, weight, bias, targets, temperature):
    """Today's unchunked path: all logits in fp32, then the losses' helpers."""
    logits = F.linear(hidden, weight, bias).float()
    logp = log_probs_from_logits(logits.unsqueeze(0), targets.unsqueeze(0), temperature)[0]
    return logp, entropy_from_logits(logits / temperature)


def inputs(n: int, dtype: torch.dtype, bias: bool = True, h: int = 8, v: int = 37, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / math.sqrt(h)).to(dtype).requires_grad_()
    b = torch.randn(v, generator=g).to(dtype).requires_grad_() if bias else None
    return hidden, weight, b, torch.randint(0, v, (n,), generator=g)


def test_hand_computed_values():
    """Logits [1, 0, 0] / T=0.5 = [2, 0, 0] for target 0 and [0, 1, 0] / 0.5 = [0, 2, 0] for target 0."""
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    logp, entropy = chunked_log_probs(hidden, weight, None, torch.tensor([0, 0]), 0.5, chunk=1, with_entropy=True)
    z = math.log(math.exp(2) + 2)  # logsumexp([2, 0, 0])
    p = math.exp(2) / (math.exp(2) + 2)
    h = -(p * math.log(p) + 2 * (1 - p) / 2 * math.log((1 - p) / 2))
    torch.testing.assert_close(logp, torch.tensor([2 - z, -z]))
    torch.testing.assert_close(entropy, torch.tensor([h, h]))


def test_gradients_pass_gradcheck():
    """The hand-derived backward (d logp / dz = onehot - p, dH / dz = -p (log p + H), / T) against finite
    differences in float64, with several chunks, a bias and both outputs used."""
    hidden, weight, bias, targets = inputs(5, torch.float64, v=7)
    torch.autograd.gradcheck(lambda h, w, b: chunked_log_probs(h, w, b, targets, 0.7, 2, with_entropy=True),
                             (hidden, weight, bias))


@pytest.mark.parametrize("with_entropy", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n,chunk", [(11, 4), (8, 8), (3, 1024)])
def test_matches_full_logits_fp32(n, chunk, bias, temperature, with_entropy):
    hidden, weight, b, targets = inputs(n, torch.float32, bias)
    g_logp, g_ent = torch.randn(n), torch.randn(n)
    logp, entropy = chunked_log_probs(hidden, weight, b, targets, temperature, chunk, with_entropy)
    want_logp, want_entropy = full(hidden, weight, b, targets, temperature)
    torch.testing.assert_close(logp, want_logp, atol=1e-6, rtol=1e-6)
    if with_entropy:
        torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=1e-6)
    else:
        assert entropy is None
    params = [hidden, weight] + ([b] if bias else [])
    loss = (logp * g_logp).sum() + ((entropy * g_ent).sum() if with_entropy else 0)
    want_loss = (want_logp * g_logp).sum() + ((want_entropy * g_ent).sum() if with_entropy else 0)
    got, want = torch.autograd.grad(loss, params), torch.autograd.grad(want_loss, params)
    for a, e in zip(got, want):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_matches_full_logits_bf16():
    """bf16 inputs: the logits are the same bf16 matmul cast to fp32, so the outputs agree closely; the weight
    gradient sums chunks in fp32 where one matmul sums all rows, which differs by bf16 rounding only."""
    hidden, weight, bias, targets = inputs(13, torch.bfloat16, v=50)
    g_logp, g_ent = torch.randn(13), torch.randn(13)
    logp, entropy = chunked_log_probs(hidden, weight, bias, targets, 0.7, 4, with_entropy=True)
    want_logp, want_entropy = full(hidden, weight, bias, targets, 0.7)
    assert logp.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logp, want_logp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-4, rtol=1e-5)
    got = torch.autograd.grad((logp * g_logp + entropy * g_ent).sum(), (hidden, weight, bias))
    want = torch.autograd.grad((want_logp * g_logp + want_entropy * g_ent).sum(), (hidden, weight, bias))
    for a, e in zip(got, want):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), e.float(), atol=2e-2, rtol=1e-2)


def test_entropy_only_gradient():
    """The log-probs unused (their gradient None): the entropy's gradient alone."""
    hidden, weight, bias, targets = inputs(6, torch.float32)
    _, entropy = chunked_log_probs(hidden, weight, bias, targets, 1.0, 4, with_entropy=True)
    want = full(hidden, weight, bias, targets, 1.0)[1]
    for a, e in zip(torch.autograd.grad(entropy.sum(), (hidden, weight, bias)),
                    torch.autograd.grad(want.sum(), (hidden, weight, bias))):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_no_positions():
    hidden, weight, bias, targets = inputs(0, torch.float32)
    logp, entropy = chunked_log_probs(hidden, weight, bias, targets, 0.7, 4, with_entropy=True)
    assert logp.shape == entropy.shape == (0,)
    (logp.sum() + entropy.sum()).backward()
    assert hidden.grad.shape == (0, 8)
    assert not weight.grad.any() and not bias.grad.any()


def test_rejects_bad_chunk_and_temperature():
    hidden, weight, bias, targets = inputs(2, torch.float32)
    with pytest.raises(ValueError, match="chunk"):
        chunked_log_probs(hidden, weight, bias, targets, 1.0, 0)
    with pytest.raises(ValueError, match="temperature"):
        chunked_log_probs(hidden, weight, bias, targets, 0.0, 4)


@pytest.mark.parametrize("chunk", [16, 0])
def test_no_tensor_spans_all_positions_and_the_vocab(chunk):
    """Forward and backward: no [N, V] tensor with chunks of 16 positions (the largest has 16 rows), while the
    full path (chunk 0 here) creates one. The weight's gradient is [V, H]: its last dimension is not V."""
    from helpers import LargestRows  # tests/ is on the path under pytest

    n, v = 100, 3001
    hidden, weight, bias, targets = inputs(n, torch.float32, h=8, v=v)
    with LargestRows(v) as seen:
        if chunk:
            logp, entropy = chunked_log_probs(hidden, weight, bias, targets, 0.7, chunk, with_entropy=True)
        else:
            logp, entropy = full(hidden, weight, bias, targets, 0.7)
        (logp.sum() + entropy.sum()).backward()
    assert seen.rows == (chunk or n)


PEAK_SCRIPT = """
import sys, torch
from rlrun.algo.vocab_chunks import chunked_log_probs
def rss(field):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))
n, h, v, chunk = (int(a) for a in sys.argv[1:])
g = torch.Generator().manual_seed(0)
hidden = torch.randn(n, h, generator=g, requires_grad=True)
weight = (torch.randn(v, h, generator=g) * 0.02).requires_grad_()
targets = torch.randint(0, v, (n,), generator=g)
logp, entropy = chunked_log_probs(hidden[:4], weight, None, targets[:4], 0.7, 4, with_entropy=True)
(logp.sum() + entropy.sum()).backward()  # the kernels' own first-use allocations, before the measurement
weight.grad = hidden.grad = None
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from the memory in use now
before = rss("VmRSS")
logp, entropy = chunked_log_probs(hidden, weight, None, targets, 0.7, chunk, with_entropy=True)
(logp.sum() + entropy.sum()).backward()
print("GROWTH", rss("VmHWM") - before, float(logp.mean()), float(entropy.mean()))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux /proc: the process's own peak RSS")
def test_peak_memory_at_qwens_vocabulary_is_a_few_chunks_not_the_logits():
    """Qwen's 151,936-token vocabulary at 2,048 positions, log-prob and entropy forward and backward in chunks of
    128 positions, in a fresh process (its peak resident memory, reset just before): the full fp32 logits alone are
    1.16 GiB, and the unchunked path holds several tensors of that size (logits, log-softmax, their gradients). The
    peak here grows by at most five [chunk, V] fp32 buffers and two [V, H] weight-sized tensors (measured: 334 MiB,
    0.28x one logits tensor)."""
    import subprocess
    import sys

    from helpers import REPO, subprocess_env

    n, h, v, chunk = 2048, 64, 151_936, 128
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(n), str(h), str(v), str(chunk)], capture_output=True,
                         text=True, timeout=300, env=subprocess_env(), cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    growth, logp_mean, entropy_mean = (float(x) for x in out.stdout.split("GROWTH")[1].split())
    logits = n * v * 4
    assert growth < 5 * chunk * v * 4 + 2 * v * h * 4, growth / 2**20
    assert growth < 0.4 * logits, growth / 2**20
    assert logp_mean < 0 and 0 < entropy_mean <= math.log(v) + 1e-3  # it computed the real thing
