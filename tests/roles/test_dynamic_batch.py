"""--dynamic_batch: token-budget micro-batches (rlrun.data.batching, the update loop, the scoring forwards).

The plan on hand-made lengths (budget respected, every row once, outputs back in row order), the gradient of
uneven micro-batches == the gradient of one full batch (every loss aggregation mode, one and two data-parallel
ranks), the equal micro-batch count over a real gloo group, the padded-token fraction on a long-tailed length
distribution, and one short 2-rank run of the demo.

Run as a script (`python test_dynamic_batch.py RANK WORLD PORT OUTDIR`) it is one gloo rank of the count test."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForSequenceClassification

from rlrun.data.rollout import RolloutBatch, pack_rows, unpack_rows
from rlrun.data.batching import (RowLengths, TokenBudget, balanced_order, balanced_shards, micro_batch_cost,
                                      padded_tokens, micro_batches_by_tokens, split_to_count, trim_padding)
from rlrun.models.loading import ScalarHeadModel
from rlrun.models.tiny import PAD_ID, build_causal_lm, tiny_model_config
from rlrun.roles.actor import Actor, PolicyData, PolicyLossSettings
from rlrun.roles.critic import Critic, ValueData
from rlrun.roles.forward import over_micro_batches, policy_log_probs, token_values
from rlrun.roles.update import Updater

CPU = torch.device("cpu")
P, R = 10, 24  # wire widths of the test batches


def lengths_of(prompt: list[int], response: list[int]) -> RowLengths:
    return RowLengths(torch.tensor(prompt), torch.tensor(response))


def long_tailed_batch(num: int = 12, seed: int = 0) -> RolloutBatch:
    """Prompts of 2..9 tokens; responses mostly 1..5 tokens, every fourth one 18..24 (the long tail)."""
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for i in range(num):
        p = int(torch.randint(2, 10, (1,), generator=g))
        r = int(torch.randint(18, R + 1, (1,), generator=g)) if i % 4 == 1 else int(torch.randint(1, 6, (1,), generator=g))
        prompts.append(torch.randint(0, 256, (p,), generator=g).tolist())
        responses.append(torch.randint(0, 256, (r,), generator=g).tolist())
    return unpack_rows(pack_rows(prompts, responses, P, R, PAD_ID), P)


# ---- the plan -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True])
def test_plan_respects_the_budget_and_places_every_row_once(packed):
    lengths = lengths_of([3, 2, 5, 4, 1, 2, 6, 3], [20, 1, 2, 18, 3, 1, 2, 9])
    plan = micro_batches_by_tokens(lengths, 48, packed)
    assert sorted(i for mb in plan for i in mb) == list(range(8))
    p, r = lengths.prompt.tolist(), lengths.response.tolist()
    for mb in plan:
        assert micro_batch_cost([p[i] for i in mb], [r[i] for i in mb], packed) <= 48, mb
    # Longest first (23, 22, 12, 8, 7, 4, 3, 3 tokens); padded: 2 x (4 + 20) = 48 holds the two long rows.
    assert plan == ([[0, 3], [7, 6, 2, 4, 1, 5]] if packed else [[0, 3], [7, 6, 2], [4, 1, 5]]), plan


def test_one_row_over_the_budget_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match=r"row 1 has 9 prompt \+ 30 response tokens, more than the token budget 32"):
        micro_batches_by_tokens(lengths_of([2, 9], [3, 30]), 32, False)


def test_split_to_count_halves_the_costliest_micro_batch():
    lengths = lengths_of([1] * 6, [9, 9, 1, 1, 1, 1])
    plan = micro_batches_by_tokens(lengths, 40, False)  # 4 rows x (1 + 9) = 40 fill the first
    assert plan == [[0, 1, 2, 3], [4, 5]]
    assert split_to_count(plan, 3, lengths, False) == [[0, 1], [2, 3], [4, 5]]
    assert split_to_count(plan, 6, lengths, False) == [[0], [1], [2], [3], [4], [5]]
    with pytest.raises(ValueError, match="6 rows cannot fill 7 micro-batches"):
        split_to_count(plan, 7, lengths, False)


def test_balanced_shards_give_equal_rows_and_close_tokens():
    totals = [100, 90, 80, 70, 10, 8, 7, 5]
    shards = balanced_shards(totals, 2)
    assert [len(s) for s in shards] == [4, 4]
    assert sorted(i for s in shards for i in s) == list(range(8))
    loads = [sum(totals[i] for i in s) for s in shards]
    assert loads == [185, 185], loads  # contiguous halves: 340 vs 30
    order = balanced_order(lengths_of(totals, [0] * 8), 2)
    assert order.tolist() == shards[0] + shards[1]
    with pytest.raises(ValueError, match="7 rows do not split evenly over 2 ranks"):
        balanced_shards(totals[:7], 2)


def test_scoring_outputs_come_back_in_row_order():
    """Per-token and per-row outputs of trimmed, reordered micro-batches land on their own rows, padded back to R."""
    batch = long_tailed_batch()
    policy = build_causal_lm(tiny_model_config(), seed=3)
    budget = TokenBudget(3 * (P + R))
    assert len(budget.split(RowLengths.of(batch))) > 2
    want = policy_log_probs(policy.eval(), batch, 1.0)[0].detach()
    got = over_micro_batches(policy, batch, budget, CPU, lambda part: policy_log_probs(policy, part, 1.0)[0])
    mask = batch.action_mask.bool()
    assert got.shape == want.shape
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=0)
    rows = over_micro_batches(policy, batch, budget, CPU, lambda part: part.attention_mask.sum(-1))
    assert rows.tolist() == (batch.prompt_len + batch.response_len).float().tolist()


def test_trim_padding_keeps_every_real_token():
    batch = long_tailed_batch()
    part = trim_padding(batch.rows(torch.tensor([0, 2, 3])))  # short rows only
    assert part.sequences.shape[1] == int(batch.prompt_len[[0, 2, 3]].max() + batch.response_len[[0, 2, 3]].max())
    assert int(part.attention_mask.sum()) == int(batch.attention_mask[[0, 2, 3]].sum())
    assert part.action_mask.sum() == batch.action_mask[[0, 2, 3]].sum()


# ---- gradients: uneven micro-batches == one full batch ----------------------------------------------------------


class _Capture:
    """Records the accumulated gradient at the optimizer step (the role's clipper)."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        self.grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
        return 0.0


def _updater(model: nn.Module, micro: int, rank: int = 0, world: int = 1) -> tuple[Updater, _Capture]:
    capture = _Capture()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return Updater(model, capture, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), 1.0, micro, rank,
                   world), capture


def _policy_inputs(batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = batch.action_mask.shape
    return torch.randn(shape, generator=g), -torch.rand(shape, generator=g) * 3, -torch.rand(shape, generator=g) * 3


def _actor_grad(agg: str, batch: RolloutBatch, budget: TokenBudget | None, rank: int = 0, world: int = 1,
                on_policy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """The actor's gradient, what its on-policy loss saw (None off-policy) and its stats."""
    from helpers import update_actor_seen  # not at the top: the ranks run this file as __main__

    adv, old, ref = _policy_inputs(batch)
    model = build_causal_lm(tiny_model_config(), seed=0)
    updater, capture = _updater(model, len(batch.prompt_len), rank, world)
    settings = PolicyLossSettings(0.2, None, agg, 1.0, 0.01, True, "k3")  # KL loss and entropy on
    actor = Actor(model, updater, settings, CPU)
    rows = [torch.arange(len(batch.prompt_len))]
    data = PolicyData(batch, None if on_policy else old, adv, ref)
    stats, seen = update_actor_seen(actor, data, rows, kl_coef=0.5, budget=budget)
    return capture.grads[0], seen, stats


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_actor_gradient_of_uneven_micro_batches_equals_the_full_batch(agg):
    from helpers import assert_close_to_scale  # not at the top: the ranks run this file as __main__

    batch = long_tailed_batch()
    budget = TokenBudget(3 * (P + R))
    updater, _ = _updater(nn.Linear(1, 1), 1)
    sizes = [len(mb) for mb in updater.micro_batches(torch.arange(12), budget, RowLengths.of(batch))]
    assert len(sizes) >= 3 and len(set(sizes)) > 1, sizes  # uneven micro-batches
    full, _, whole = _actor_grad(agg, batch, None)
    dynamic, _, split = _actor_grad(agg, batch, budget)
    assert_close_to_scale(dynamic, full)
    # the logged losses are the mini-batch's, not a micro-batch's share of it
    for key in ("actor/policy_loss", "actor/kl_loss", "actor/entropy"):
        assert split[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-6), key
    assert whole["actor/entropy"] > 1.0  # a near-uniform tiny model: ~ln(vocab) nats per token
    # Two data-parallel ranks, rows dealt by length: the mean of their gradients (what FSDP's reduction gives).
    halves = [_actor_grad(agg, batch, budget, rank, 2)[0] for rank in range(2)]
    assert_close_to_scale((halves[0] + halves[1]) / 2, full)


def test_on_policy_log_probs_of_trimmed_micro_batches_fill_the_full_width():
    batch = long_tailed_batch()
    _, a, _ = _actor_grad("token-mean", batch, None, on_policy=True)
    _, b, _ = _actor_grad("token-mean", batch, TokenBudget(3 * (P + R)), on_policy=True)
    assert a is not None and b is not None
    assert a.shape == b.shape == (12, 1 + batch.response_width)
    a, b = a[a[:, 0].argsort()], b[b[:, 0].argsort()]
    mask = batch.action_mask.bool()
    torch.testing.assert_close(b[:, 1:][mask], a[:, 1:][mask], atol=1e-5, rtol=0)


def _scalar_model(seed: int = 1) -> ScalarHeadModel:
    cfg = tiny_model_config()
    cfg.num_labels = 1
    torch.manual_seed(seed)
    return ScalarHeadModel(AutoModelForSequenceClassification.from_config(cfg))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_critic_gradient_of_uneven_micro_batches_equals_the_full_batch(agg):
    from helpers import assert_close_to_scale, update_critic  # not at the top: the ranks run this file as __main__

    batch = long_tailed_batch(seed=4)
    returns, old = _policy_inputs(batch)[:2]
    grads, losses = [], []
    for budget in (None, TokenBudget(3 * (P + R))):
        model = _scalar_model()
        updater, capture = _updater(model, 12)
        critic = Critic(model, updater, 0.5, agg, CPU)
        stats = update_critic(critic, ValueData(batch, old, returns), [torch.arange(12)], budget)
        grads.append(capture.grads[0])
        losses.append(stats["critic/value_loss"])
        assert 0 <= stats["critic/padded_token_frac"] < 1
    assert_close_to_scale(grads[1], grads[0])
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)  # the mini-batch's loss, however it was split
    model = _scalar_model().eval()
    values = token_values(model, batch).detach()
    scored = over_micro_batches(model, batch, TokenBudget(2 * (P + R)), CPU, lambda part: token_values(model, part))
    mask = batch.action_mask.bool()
    torch.testing.assert_close(scored[mask], values[mask], atol=1e-5, rtol=0)


# ---- the padded-token fraction -----------------------------------------------------------------------------------


def test_padded_fraction_drops_by_a_third_on_long_tailed_lengths():
    """256 rows, 85% with short responses and 15% near the cap: micro-batches by tokens (as many as fixed ones of 8
    rows, so the same average size) pad >= 30% fewer tokens than fixed micro-batches of shuffled rows, each of those
    cut to its own longest row too (today's fixed micro-batches keep the whole step's width: the larger baseline)."""
    rng = random.Random(0)
    n, micro, cap = 256, 8, 512
    prompt = [rng.randint(20, 60) for _ in range(n)]
    response = [rng.randint(cap - 64, cap) if rng.random() < 0.15 else rng.randint(10, 120) for _ in range(n)]
    lengths = lengths_of(prompt, response)
    order = list(range(n))
    rng.shuffle(order)  # a mini-batch is a shuffled draw of the rollouts
    fixed = [order[i:i + micro] for i in range(0, n, micro)]
    pad_fixed, fed_fixed = padded_tokens(lengths, fixed)
    real = sum(prompt) + sum(response)
    whole_width = n * (max(prompt) + max(response))  # today: every micro-batch as wide as the step's longest row
    budget = next(b for b in range(cap + 60, 100 * cap) if len(micro_batches_by_tokens(lengths, b, False)) <= n // micro)
    dynamic = split_to_count(micro_batches_by_tokens(lengths, budget, False), n // micro, lengths, False)
    pad_dynamic, fed_dynamic = padded_tokens(lengths, dynamic)
    frac = {"whole_width": 1 - real / whole_width, "fixed": pad_fixed / fed_fixed, "dynamic": pad_dynamic / fed_dynamic}
    print(f"padded-token fraction: {frac} (budget {budget} tokens, {len(dynamic)} micro-batches)")
    assert len(dynamic) == len(fixed)
    assert pad_dynamic <= 0.7 * pad_fixed, frac
    assert frac["dynamic"] <= 0.7 * frac["fixed"], frac


# ---- the micro-batch count agreed over a real group -----------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, outdir: Path) -> None:
    """Rank 0 holds 4 short rows (one micro-batch by itself), rank 1 four long ones (four by itself)."""
    import functools

    import torch.distributed as dist

    from rlrun.launch.transfer import max_over

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    budget = TokenBudget(64, agree=functools.partial(max_over, group=dist.group.WORLD, device=CPU))
    lengths = lengths_of([4] * 4, [3, 2, 4, 1] if rank == 0 else [50, 40, 45, 30])
    alone = len(micro_batches_by_tokens(lengths, 64, False))
    parts = budget.split(lengths)
    (outdir / f"rank{rank}.json").write_text(json.dumps({"alone": alone, "parts": [p.tolist() for p in parts]}))
    dist.destroy_process_group()


def test_every_rank_runs_the_same_number_of_micro_batches(tmp_path):
    from helpers import run_file_as_ranks  # not at the top: the ranks run this file as __main__

    run_file_as_ranks(__file__, 2, tmp_path, timeout=120)
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [o["alone"] for o in out] == [1, 4]
    assert [len(o["parts"]) for o in out] == [4, 4]
    for o in out:
        assert sorted(i for part in o["parts"] for i in part) == [0, 1, 2, 3]


# ---- end to end --------------------------------------------------------------------------------------------------


def test_demo_on_two_ranks_with_dynamic_batch_logs_the_padded_fraction(tmp_path):
    from helpers import REPO, run_rlrun

    run = run_rlrun(2, ["--config", str(REPO / "configs" / "demo.yaml"), "--max_steps", "4", "--dynamic_batch",
                        "--train_max_tokens_per_gpu", "256"], tmp_path, timeout=300)
    assert run.returncode == 0, run.output[-3000:]
    assert len(run.metrics) == 4
    for m in run.metrics:
        assert 0 <= m["actor/padded_token_frac"] < 1 and m["actor/micro_batches"] >= 1, m
    print("actor/padded_token_frac per step:", [round(m["actor/padded_token_frac"], 3) for m in run.metrics])


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
