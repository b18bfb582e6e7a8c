"""--packing_samples: every role's forward on packed rows equals the padded forward on the response tokens,
and so do the gradients and the parameters after a training step; also under FSDP2 on 1 and 2 ranks.

Run as a script (`python test_forward_packing.py RANK WORLD PORT OUTDIR`) it is one FSDP2 rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForSequenceClassification

from rlrun.algo.policy_losses import policy_loss
from rlrun.data.rollout import RolloutBatch, pack_rows, unpack_rows
from rlrun.models.loading import ScalarHeadModel
from rlrun.models.tiny import PAD_ID, build_causal_lm, tiny_model_config
from rlrun.roles.actor import Actor, PolicyData, PolicyLossSettings
from rlrun.roles.critic import Critic, ValueData
from rlrun.roles.forward import policy_log_probs, sequence_scores, token_values
from rlrun.roles.update import warmup_cosine
from rlrun.roles.actor import Reference
from rlrun.roles.critic import RewardModel
from rlrun.roles.update import Updater

ATOL = 1e-5
CPU = torch.device("cpu")


def varied_batch(num: int = 8, seed: int = 0) -> RolloutBatch:
    """Prompts of 1..9 tokens and responses of 0..12 tokens, padded like a real rollout."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i in range(num):
        p = int(torch.randint(1, 10, (1,), generator=g))
        r = 0 if i == 3 else int(torch.randint(1, 13, (1,), generator=g))
        prompts.append(torch.randint(0, 256, (p,), generator=g).tolist())
        responses.append(torch.randint(0, 256, (r,), generator=g).tolist())
    return unpack_rows(pack_rows(prompts, responses, 10, 12, PAD_ID), 10)


def scalar_model(seed: int = 1) -> ScalarHeadModel:
    cfg = tiny_model_config()
    cfg.num_labels = 1
    torch.manual_seed(seed)
    return ScalarHeadModel(AutoModelForSequenceClassification.from_config(cfg))


class _Clip:
    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], max_norm))


def _masked(x: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    return x * batch.action_mask


def test_packed_log_probs_never_pass_a_tensor_logits_to_keep(monkeypatch):
    """transformers before 5.2x indexes `hidden[:, logits_to_keep]`, so a 2-D mask fails there (seen on an H200 with
    transformers 5.17): the packed path trims the vocab projection's input itself and works on any version."""
    batch = varied_batch()
    policy = build_causal_lm(tiny_model_config(), seed=3).eval()
    forward = policy.forward

    def old_transformers_forward(*args, **kwargs):
        assert not isinstance(kwargs.get("logits_to_keep", 0), torch.Tensor), "a tensor logits_to_keep"
        return forward(*args, **kwargs)

    monkeypatch.setattr(policy, "forward", old_transformers_forward)
    with torch.no_grad():
        packed, _ = policy_log_probs(policy, batch, 0.7, packing=True)
        padded, _ = policy_log_probs(policy, batch, 0.7)
    torch.testing.assert_close(packed, _masked(padded, batch), atol=ATOL, rtol=0)
    assert not policy.get_output_embeddings()._forward_pre_hooks  # the trimming hook is gone afterwards


def test_log_probs_values_and_scores_match_padded():
    batch = varied_batch()
    assert batch.response_len.tolist().count(0) == 1 and len(set(batch.prompt_len.tolist())) > 3
    policy = build_causal_lm(tiny_model_config(), seed=3).eval()
    critic = scalar_model()
    with torch.no_grad():
        padded, ent_padded = policy_log_probs(policy, batch, 0.7, with_entropy=True)
        packed, ent_packed = policy_log_probs(policy, batch, 0.7, with_entropy=True, packing=True)
        torch.testing.assert_close(packed, _masked(padded, batch), atol=ATOL, rtol=0)
        torch.testing.assert_close(ent_packed, _masked(ent_padded, batch), atol=ATOL, rtol=0)
        values = token_values(critic, batch)
        torch.testing.assert_close(token_values(critic, batch, packing=True), _masked(values, batch), atol=ATOL, rtol=0)
        torch.testing.assert_close(sequence_scores(critic, batch, packing=True), sequence_scores(critic, batch),
                                   atol=ATOL, rtol=0)
    # Through the roles, in micro-batches of 3 (the last one short).
    for packing in (False, True):
        ref = Reference(policy, 0.7, CPU, packing=packing).log_probs(batch, 3)
        rm = RewardModel(critic, CPU, packing=packing).score(batch, 3)
        if not packing:
            ref_padded, rm_padded = ref, rm
    torch.testing.assert_close(ref, _masked(ref_padded, batch), atol=ATOL, rtol=0)
    torch.testing.assert_close(rm, rm_padded, atol=ATOL, rtol=0)
    assert bool((ref != 0).any()) and rm.shape == (8,)


def test_policy_and_value_gradients_match_padded():
    from helpers import assert_close_to_scale  # not at the top: the ranks run this file as __main__

    batch = varied_batch(seed=1)
    adv = torch.linspace(-1, 1, batch.action_mask.numel()).view_as(batch.action_mask)
    grads = {}
    for packing in (False, True):
        policy = build_causal_lm(tiny_model_config(), seed=3)
        logp, _ = policy_log_probs(policy, batch, 1.0, packing=packing)
        old = logp.detach() - 0.05  # ratio exp(0.05): inside the clip range, so every token has a gradient
        loss, _ = policy_loss(logp, old, adv, batch.action_mask, eps_clip=0.2, dual_clip=None, agg="token-mean")
        loss.backward()
        critic = scalar_model()
        values = token_values(critic, batch, packing=packing)
        ((values - 1.0) ** 2 * batch.action_mask).sum().backward()
        grads[packing] = [p.grad.clone() for p in policy.parameters()] + [p.grad.clone() for p in critic.parameters()]
    assert len(grads[True]) == len(grads[False])
    for a, b in zip(grads[False], grads[True]):
        assert_close_to_scale(b, a)
    assert max(float(g.abs().max()) for g in grads[True]) > 1e-3


def test_sequence_by_sequence_attention_matches_padded(monkeypatch):
    """Packed rows without flash-attention as runs attend them (strategies/ulysses.py without a split; the GPU
    default packs): the micro-batch is one row of its real tokens, each sequence its own causal sdpa, and no mask is
    built for it; log-probs, entropy, values, scores and gradients equal the padded forward's (fp32). A padded
    forward of the same switched model still masks its padding."""
    from helpers import assert_close_to_scale  # not at the top: the ranks run this file as __main__
    from transformers.masking_utils import AttentionMaskInterface

    from rlrun.roles.forward import pack_for
    from rlrun.strategies import ulysses

    batch = varied_batch(seed=1)
    plain, policy = build_causal_lm(tiny_model_config(), seed=3), build_causal_lm(tiny_model_config(), seed=3)
    plain_critic, critic = scalar_model(), scalar_model()
    assert ulysses.packs_by_sequence(policy) and ulysses.packs_by_sequence(critic)
    ulysses.enable(policy)
    ulysses.enable(critic)
    assert pack_for(policy, batch).input_ids.shape[0] == 1 and pack_for(plain, batch).input_ids.shape[0] > 1
    built = []
    mask_fn = AttentionMaskInterface._global_mapping[ulysses.ULYSSES]
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, ulysses.ULYSSES,
                        lambda *a, **k: built.append(1) or mask_fn(*a, **k))
    adv = torch.linspace(-1, 1, batch.action_mask.numel()).view_as(batch.action_mask)
    out = {}
    for name, (lm, head, packing) in {"padded": (plain, plain_critic, False), "by_sequence": (policy, critic, True)}.items():
        logp, entropy = policy_log_probs(lm, batch, 0.7, with_entropy=True, packing=packing)
        loss, _ = policy_loss(logp, logp.detach() - 0.05, adv, batch.action_mask, eps_clip=0.2, dual_clip=None,
                              agg="token-mean")
        (loss + (entropy * batch.action_mask).sum()).backward()
        values = token_values(head, batch, packing=packing)
        ((values - 1.0) ** 2 * batch.action_mask).sum().backward()
        with torch.no_grad():
            scores = sequence_scores(head, batch, packing=packing)
        out[name] = (_masked(logp, batch), _masked(entropy, batch), _masked(values, batch), scores,
                     [p.grad for p in [*lm.parameters(), *head.parameters()]])
    assert not built, "a packed forward built a mask"
    for want, got in zip(out["padded"][:4], out["by_sequence"][:4]):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    for want, got in zip(out["padded"][4], out["by_sequence"][4]):
        assert_close_to_scale(got, want)
    with torch.no_grad():  # padded rows through the switched model: its padding is masked (sdpa's mask, built)
        torch.testing.assert_close(policy_log_probs(policy, batch, 0.7)[0], policy_log_probs(plain, batch, 0.7)[0],
                                   atol=ATOL, rtol=0)
    assert built


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    # SGD, not Adam: Adam's first step is about lr * sign(grad), so a parameter whose true gradient is 0 (the key
    # bias: softmax ignores a constant shift) would move by +-lr on float noise alone.
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _actor(packing: bool) -> Actor:
    model = build_causal_lm(tiny_model_config(), seed=3)
    opt = _sgd(model)
    updater = Updater(model, _Clip(), opt, warmup_cosine(opt, 10, 0.0), 1.0, micro_batch=3, dp_rank=0, dp_size=1)
    settings = PolicyLossSettings(eps_clip=0.2, dual_clip=None, agg="token-mean", temperature=1.0, entropy_coef=0.0,
                                  use_kl_loss=True, kl_estimator="k3")
    kwargs = {f: getattr(settings, f) for f in settings.__dataclass_fields__}
    return Actor(model, updater, PolicyLossSettings(**kwargs), CPU, packing=packing)


def test_training_step_matches_padded():
    """Actor and critic: one optimizer step on packed rows leaves the same parameters as on padded rows."""
    from helpers import update_actor, update_critic  # not at the top: the ranks run this file as __main__

    batch = varied_batch(seed=2)
    adv = torch.linspace(-1, 1, batch.action_mask.numel()).view_as(batch.action_mask)
    ref = build_causal_lm(tiny_model_config(), seed=4)
    with torch.no_grad():
        ref_lp = policy_log_probs(ref, batch, 1.0)[0]
    params, stats = {}, {}
    for packing in (False, True):
        actor = _actor(packing)
        old = actor.log_probs(batch, 3)
        stats[packing] = update_actor(actor, PolicyData(batch, old, adv, ref_lp), [torch.arange(8)], kl_coef=0.1)
        model = scalar_model()
        opt = _sgd(model)
        critic = Critic(model, Updater(model, _Clip(), opt, warmup_cosine(opt, 10, 0.0), 1.0, 3, 0, 1), 0.5,
                        "token-mean", CPU, packing=packing)
        old_values = critic.values(batch, 3)
        update_critic(critic, ValueData(batch, old_values, torch.ones_like(old_values)), [torch.arange(8)])
        params[packing] = [p.detach().clone() for p in actor.model.parameters()] + \
                          [p.detach().clone() for p in model.parameters()]
    for a, b in zip(params[False], params[True]):
        torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
    for key in ("actor/policy_loss", "actor/kl_loss", "actor/entropy"):
        assert abs(stats[True][key] - stats[False][key]) < ATOL, key
    start = build_causal_lm(tiny_model_config(), seed=3)
    assert any(not torch.equal(p, q) for p, q in zip(start.parameters(), params[True]))


# ---- FSDP2 ---------------------------------------------------------------------------------------------------


def _fsdp_rank(rank: int, world: int, port: int, outdir: Path) -> None:
    """Padded and packed on the same FSDP2-wrapped models; rank r scores and trains on its half of the rows."""
    import torch.distributed as dist

    from rlrun.strategies.fsdp import FSDPStrategy

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    batch = varied_batch(seed=5)
    mine = batch.rows(slice(rank * 8 // world, (rank + 1) * 8 // world))
    strategy = FSDPStrategy(dist.group.WORLD, CPU, bf16=False, zero_stage=2, offload=False, gradient_checkpointing=False)
    out: dict[str, dict[bool, object]] = {"logp": {}, "values": {}, "scores": {}, "grads": {}}
    for packing in (False, True):
        policy = strategy.wrap(build_causal_lm(tiny_model_config(), seed=3))
        critic = strategy.wrap(scalar_model())
        with torch.no_grad():
            out["logp"][packing] = _masked(policy_log_probs(policy, mine, 1.0, packing=packing)[0], mine)
            out["values"][packing] = _masked(token_values(critic, mine, packing=packing), mine)
            out["scores"][packing] = sequence_scores(critic, mine, packing=packing)
        logp, _ = policy_log_probs(policy, mine, 1.0, packing=packing)
        values = token_values(critic, mine, packing=packing)
        (((logp * 0.3) + (values - 1.0) ** 2) * mine.action_mask).sum().backward()
        out["grads"][packing] = [strategy_full(p.grad) for p in (*policy.parameters(), *critic.parameters())]
    torch.save(out, outdir / f"rank{rank}.pt")
    dist.destroy_process_group()


def strategy_full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_packed_matches_padded(tmp_path, world):
    from helpers import assert_close_to_scale, run_file_as_ranks  # not at the top: the ranks run this file as __main__

    run_file_as_ranks(__file__, world, tmp_path, timeout=240)
    for r in range(world):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        for key in ("logp", "values", "scores"):
            torch.testing.assert_close(res[key][True], res[key][False], atol=ATOL, rtol=0)
        for a, b in zip(res["grads"][False], res["grads"][True]):
            assert_close_to_scale(b, a)
        assert max(float(g.abs().max()) for g in res["grads"][True]) > 1e-3


if __name__ == "__main__":
    _fsdp_rank(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
