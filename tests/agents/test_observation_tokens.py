"""Observation tokens (action mask 0 inside the response) carry no gradient, no KL and no advantage.

Real Actor and Updater on the real tiny model: the update's gradient does not change when the
advantages, reference log-probs or old log-probs of observation tokens change, and does change when
those of a generated token do (so the check can fail)."""

from __future__ import annotations

import torch

from helpers import update_actor
from rlrun.algo.algorithms import compute_advantages, compute_approx_kl, sequence_mean_kl
from rlrun.data.rollout import pack_log_probs, pack_rows, unpack_rows
from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config
from rlrun.roles.actor import Actor, PolicyData, PolicyLossSettings
from rlrun.roles.update import Updater

TOK = build_byte_tokenizer()
CPU = torch.device("cpu")
# Response layout of both rows: 3 action tokens, 4 observation tokens, 2 action tokens.
MASK = [1, 1, 1, 0, 0, 0, 0, 1, 1]
OBS = [i for i, m in enumerate(MASK) if m == 0]


class _Capture:
    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        self.grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        return 0.0


def _batch():
    prompts = [TOK.encode("Q1:", add_special_tokens=False), TOK.encode("Q22:", add_special_tokens=False)]
    responses = [TOK.encode("ab<obs>cd", add_special_tokens=False)[:9], TOK.encode("xy[ob]zw", add_special_tokens=False) + [5]]
    batch = unpack_rows(pack_rows(prompts, responses, 8, 12, TOK.pad_token_id), 8)
    batch.action_mask = pack_log_probs([MASK, MASK], 12)[:, :batch.response_width]
    return batch


def _grad(adv: torch.Tensor, ref: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    model = build_causal_lm(tiny_model_config(), seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    capture = _Capture()
    updater = Updater(model, capture, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), max_norm=1.0,
                      micro_batch=2, dp_rank=0, dp_size=1)
    settings = PolicyLossSettings(0.2, None, "token-mean", 1.0, 0.01, True, "k3")  # KL loss and entropy on
    actor = Actor(model, updater, settings, CPU)
    batch = _batch()
    update_actor(actor, PolicyData(batch, old, adv, ref), [torch.arange(2)], kl_coef=0.5)
    return capture.grads[0]


def test_observation_tokens_get_no_gradient() -> None:
    g = torch.Generator().manual_seed(0)
    adv, ref, old = torch.randn(2, 9, generator=g), -torch.rand(2, 9, generator=g) * 3, -torch.rand(2, 9, generator=g) * 3
    base = _grad(adv, ref, old)
    assert base.abs().sum() > 0
    changed = adv.clone(), ref.clone(), old.clone()
    for t in changed:
        t[:, OBS] = torch.randn(2, len(OBS), generator=g) * 100  # anything at all on observation tokens
    assert torch.equal(_grad(*changed), base)
    action = adv.clone()
    action[:, 0] += 1.0
    assert not torch.allclose(_grad(action, ref, old), base)


def test_observation_tokens_get_no_kl_and_no_advantage() -> None:
    mask = torch.tensor([MASK], dtype=torch.float32)
    logp, ref = torch.full((1, 9), -1.0), torch.full((1, 9), -3.0)
    kl = compute_approx_kl(logp, ref, "k1", mask)
    assert kl[0, OBS].abs().sum() == 0 and kl[0, 0] == 2.0
    # The sequence's mean KL counts its 5 action tokens only.
    assert sequence_mean_kl(kl, mask) == 2.0
    values = torch.arange(9, dtype=torch.float32).unsqueeze(0) / 10
    for estimator in ("gae", "reinforce"):
        adv, ret = compute_advantages(estimator, torch.tensor([1.0]), mask, n_samples_per_prompt=1, kl=kl,
                                      kl_coef=0.1, values=values if estimator == "gae" else None, gamma=1.0, lambd=1.0,
                                      reward_clip_range=(-10.0, 10.0), std_norm=False)
        assert adv[0, OBS].abs().sum() == 0 and ret[0, OBS].abs().sum() == 0, estimator
