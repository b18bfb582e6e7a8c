"""Tinker's built-in losses, with its SUM semantics: each datum's loss is the sum over its tokens, a call's loss
the sum over its data (`loss:sum`), never a mean (https://tinker-docs.thinkingmachines.ai/tinker/losses).

Every loss reads the learner's log-probs of the datum's `target_tokens` (`logp`, [N] fp32, position i of the model
input predicting target i) and the datum's other inputs ([N] each); Δ = logp - the sampler's `logprobs`, r = exp(Δ).

    cross_entropy        -Σ weights · logp
    importance_sampling  -Σ r · A
    ppo                  -Σ min(r · A, clip(r, lo, hi) · A)               lo, hi = 0.8, 1.2
    cispo                -Σ sg(clip(r, lo, hi)) · logp · A                lo, hi = 0.0, 4.0
    dro                  -Σ (logp · A - β/2 · Δ²)                         β required
    gspo                 -Σ min(s_t · A, clip(s_t, lo, hi) · A)           lo, hi = 0.8, 1.2
                         s_t = sg(s) · exp(logp_t - sg(logp_t)), s = exp(mean of Δ over sequence_ratio_mask)

(sg: no gradient; lo/hi: loss_fn_config's clip_low_threshold / clip_high_threshold.) The policy-gradient losses
also take optional per-token `weights` that multiply each token's term (the cookbook masks by zero advantages
instead: the same result). `custom` is the SDK's: it runs on the client over `forward`'s log-probs and comes back
as cross_entropy with signed weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from rlrun.runtime.errors import RlrunError


class LossInputError(RlrunError):
    """A request's loss inputs do not fit its loss (refused before any rank computes)."""


@dataclass(frozen=True)
class LossSpec:
    """One loss: its required and optional per-token inputs, its config keys with defaults (None: required), and
    the per-datum loss (logp [N], inputs {key: [N]}, config) -> scalar."""

    required: tuple[str, ...]
    optional: tuple[str, ...]
    config: Mapping[str, float | None]
    fn: Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], Tensor]


def _weighted(terms: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
    """Σ of per-token terms [N], each times its `weights` when the datum has them."""
    weights = inputs.get("weights")
    return (terms if weights is None else terms * weights).sum()


def cross_entropy(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    return -(logp * inputs["weights"]).sum()


def importance_sampling(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    return -_weighted(ratio * inputs["advantages"], inputs)


def _clipped(ratio: Tensor, advantages: Tensor, config: Mapping[str, float]) -> Tensor:
    """Per token: min(r · A, clip(r, lo, hi) · A)."""
    clipped = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
    return torch.minimum(ratio * advantages, clipped * advantages)


def ppo(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    return -_weighted(_clipped(ratio, inputs["advantages"], config), inputs)


def cispo(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    coef = ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    return -_weighted(coef * logp * inputs["advantages"], inputs)


def dro(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    delta = logp - inputs["logprobs"]
    return -_weighted(logp * inputs["advantages"] - 0.5 * config["beta"] * delta.square(), inputs)


def gspo(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    delta = logp - inputs["logprobs"]
    mask = inputs.get("sequence_ratio_mask")
    mask = torch.ones_like(delta) if mask is None else mask
    sequence = torch.exp((delta * mask).sum() / mask.sum().clamp_min(1.0))
    token = sequence.detach() * torch.exp(logp - logp.detach())
    return -_weighted(_clipped(token, inputs["advantages"], config), inputs)


_RL = ("target_tokens", "logprobs", "advantages")
_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSSES: Mapping[str, LossSpec] = {
    "cross_entropy": LossSpec(("target_tokens", "weights"), (), {}, cross_entropy),
    "importance_sampling": LossSpec(_RL, ("weights",), {}, importance_sampling),
    "ppo": LossSpec(_RL, ("weights",), _CLIP, ppo),
    "cispo": LossSpec(_RL, ("weights",), {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, cispo),
    "dro": LossSpec(_RL, ("weights",), {"beta": None}, dro),
    "gspo": LossSpec(_RL, ("weights", "sequence_ratio_mask"), _CLIP, gspo),
}


def loss_config(name: str, given: Mapping[str, float] | None) -> dict[str, float]:
    """`name`'s config: `given` over its defaults; one error naming an unknown or missing key."""
    spec = LOSSES[name]
    given = dict(given or {})
    unknown = sorted(set(given) - set(spec.config))
    if unknown:
        allowed = ", ".join(spec.config) or "none"
        raise LossInputError(f"loss_fn_config keys {unknown} are not {name}'s (it takes: {allowed})")
    out: dict[str, float] = {}
    for key, default in spec.config.items():
        value = given.get(key, default)
        if value is None:
            raise LossInputError(f"loss_fn {name} needs loss_fn_config[{key!r}]")
        out[key] = float(value)
    return out


def check_inputs(name: str, keys: set[str], length: int, lengths: Mapping[str, int], index: int) -> None:
    """Datum `index`'s inputs fit loss `name`: its required keys, nothing unknown, each input as long as the model
    input (`length` tokens)."""
    spec = LOSSES[name]
    missing = [k for k in spec.required if k not in keys]
    if missing:
        raise LossInputError(f"datum {index}: loss_fn {name} needs loss_fn_inputs {missing} (it has {sorted(keys)})")
    unknown = sorted(keys - set(spec.required) - set(spec.optional))
    if unknown:
        raise LossInputError(
            f"datum {index}: loss_fn_inputs {unknown} are not used by {name} (it takes "
            f"{', '.join((*spec.required, *spec.optional))})"
        )
    for key, n in lengths.items():
        if n != length:
            raise LossInputError(f"datum {index}: loss_fn_inputs[{key!r}] has {n} values for {length} input tokens")
