"""Log-probs and entropy of target tokens through the vocab projection, a chunk of positions at a time.

The full logits of a micro-batch ([N, V] in fp32: 4k tokens x 152k vocabulary is 2.5 GB, and softmax,
log_softmax and their gradients multiply it) are never built: the forward keeps one [c, V] chunk alive at a
time and saves only the inputs and a logsumexp per position; the backward recomputes each chunk's logits.
The numbers are those of `log_probs_from_logits` / `entropy_from_logits` (rlrun.algo.losses) on
`linear(hidden, weight, bias).float() / temperature`, up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """[c, H] -> z = [c, V] fp32 (fp64 for fp64 inputs) logits / temperature. The matmul runs in the inputs' dtype
    and is cast after, as `head(hidden).float()` does, so bf16 models get the same logits as unchunked."""
    z = F.linear(h, weight, bias)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z.div_(temperature) if temperature != 1.0 else z


class _VocabChunks(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], bias [V] | None, targets [N]) -> (logp [N], entropy [N] or [0]), fp32 or fp64."""

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        chunk: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        logp = hidden.new_empty(n, dtype=dtype)
        lse = hidden.new_empty(n, dtype=dtype)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=dtype)
        for s in range(0, n, chunk):
            rows = slice(s, min(s + chunk, n))
            z = _chunk_logits(hidden[rows], weight, bias, temperature)
            lse[rows] = torch.logsumexp(z, dim=-1)
            logp[rows] = z.gather(1, targets[rows, None]).squeeze(1) - lse[rows]
            if with_entropy:
                # H = lse - sum_v p_v z_v; a batched row dot instead of (p * z).sum spares one more [c, V] buffer.
                p = (z - lse[rows, None]).exp_()
                entropy[rows] = lse[rows] - (p.unsqueeze(1) @ z.unsqueeze(2)).view(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_entropy: Tensor | None):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_logp is None and g_entropy is None:
            return None, None, None, None, None, None, None
        n = hidden.shape[0]
        grad_h = torch.empty_like(hidden) if need_h else None
        # Weight/bias gradients sum over all chunks: accumulate in fp32 and cast once, so a bf16 model does not
        # round the running sum once per chunk (the unchunked matmul accumulates in fp32 internally too).
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros_like(weight, dtype=acc) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=acc) if need_b else None
        for s in range(0, n, ctx.chunk):
            rows = slice(s, min(s + ctx.chunk, n))
            h = hidden[rows]
            z = _chunk_logits(h, weight, bias, ctx.temperature)
            p = (z - lse[rows, None]).exp_()
            # z = logits / T, p = softmax(z), logp_t = z_t - lse, H = -sum_v p_v log p_v:
            #   d logp_t / d z_v = [v == t] - p_v,    d H / d z_v = -p_v (log p_v + H),  log p_v = z_v - lse.
            # grad_z = -p * (g_logp + g_H (z - lse + H)), then + g_logp at the target; built in z's buffer.
            if g_entropy is not None:
                grad_z = z.sub_((lse[rows] - entropy[rows])[:, None]).mul_(g_entropy[rows, None])
                if g_logp is not None:
                    grad_z.add_(g_logp[rows, None])
                grad_z.mul_(p).neg_()
            else:
                assert g_logp is not None  # both None returned above
                grad_z = p.mul_(-g_logp[rows, None])
            if g_logp is not None:
                grad_z.scatter_add_(1, targets[rows, None], g_logp[rows, None])
            if ctx.temperature != 1.0:
                grad_z.div_(ctx.temperature)
            grad_logits = grad_z.to(weight.dtype)  # the cast `.float()` undoes in autograd on the unchunked path
            if grad_h is not None:
                grad_h[rows] = grad_logits @ weight
            if grad_w is not None and weight.dtype == acc:
                grad_w.addmm_(grad_logits.t(), h)
            elif grad_w is not None:
                grad_w.add_(grad_logits.t() @ h)  # addmm_ cannot mix dtypes: one [V, H] product in weight's dtype
            if grad_b is not None:
                grad_b.add_(grad_logits.sum(0, dtype=acc))
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


def chunked_log_probs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float,
    chunk: int,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of `targets` and entropy under softmax((hidden @ weight.T + bias) / temperature), c positions at a time.

    hidden: [N, H] (any float dtype), weight: [V, H] and bias: [V] in hidden's dtype, targets: [N] int.
    Returns logp [N] and entropy [N] (None unless `with_entropy`) in fp32 (fp64 for fp64 inputs), both
    differentiable w.r.t. hidden, weight and bias. Peak extra memory: a few [chunk, V] fp32 buffers and, in backward,
    an fp32 [V, H] accumulator for the weight gradient (plus one [V, H] product per chunk for bf16 weights);
    no [N, V] tensor is ever created.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk <= 0:
        raise ValueError(f"chunk must be > 0 positions, got {chunk}")
    logp, entropy = _VocabChunks.apply(hidden, weight, bias, targets.long(), float(temperature), chunk, with_entropy)
    return logp, entropy if with_entropy else None
