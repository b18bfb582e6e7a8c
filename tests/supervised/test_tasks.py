"""The supervised tasks on the real tiny model, in one process: batches shaped like rollouts, packed rows give
the padded numbers, losses normalised by the global batch, reward statistics as OpenRLHF stores them."""

from __future__ import annotations

import math

import pytest
import torch

from rlrun.config.model import PretrainedConfig
from rlrun.models.loading import ScalarHeadModel, init_score_head, load_causal_lm, scalar_model_from
from rlrun.supervised.tasks import sequences_batch
from rlrun.supervised.datasets import Completion, Preference
from rlrun.supervised.tasks import DPOSettings, DPOTask
from rlrun.supervised.tasks import RewardModelTask
from rlrun.supervised.tasks import SFTTask

CPU = torch.device("cpu")
PAD = 0


def _policy() -> torch.nn.Module:
    return load_causal_lm(PretrainedConfig(attn_implementation="sdpa"), seed=3)


COMPLETIONS = [Completion([5, 6, 7], [8, 9]), Completion([5], [10, 11, 12, 13]), Completion([], [14, 15, 16])]
PAIRS = [Preference([5, 6], [7, 8, 9], [10]), Preference([11], [12], [13, 14, 15]), Preference([], [16, 17], [18, 19])]


def test_rows_are_prompt_then_response_and_a_promptless_row_gives_its_first_token_as_context() -> None:
    batch = sequences_batch([c.prompt for c in COMPLETIONS], [c.response for c in COMPLETIONS], PAD)
    assert batch.sequences.tolist() == [[5, 6, 7, 8, 9, 0, 0], [0, 0, 5, 10, 11, 12, 13], [0, 0, 14, 15, 16, 0, 0]]
    assert batch.action_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch.prompt_len.tolist() == [3, 1, 1] and batch.response_len.tolist() == [2, 4, 2]


def test_sft_loss_is_the_token_mean_nll_and_packing_gives_the_same() -> None:
    model = _policy()
    padded = SFTTask(model, None, None, CPU, PAD, packing=False)  # type: ignore[arg-type]
    packed = SFTTask(model, None, None, CPU, PAD, packing=True)  # type: ignore[arg-type]
    tokens = sum(padded.loss_tokens(c) for c in COMPLETIONS)
    assert tokens == 8
    loss = padded.micro_loss(COMPLETIONS, num_tokens=tokens, num_seqs=3)
    torch.testing.assert_close(packed.micro_loss(COMPLETIONS, num_tokens=tokens, num_seqs=3), loss, rtol=1e-5, atol=1e-6)
    # By hand: the mean over the 8 response tokens of -log softmax(logits at the previous position)[token].
    nll = []
    for c in COMPLETIONS:
        prompt, response = (c.prompt, c.response) if c.prompt else (c.response[:1], c.response[1:])
        ids = torch.tensor([prompt + response])
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
        nll += [-logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)]
    assert loss.item() == pytest.approx(sum(nll) / 8, rel=1e-5)
    sums = padded.tally.take()
    assert sums["tokens"] == 8 and padded.summary(sums, evaluation=False)["loss"] == pytest.approx(loss.item(), rel=1e-6)


def test_dpo_at_the_reference_is_log2_per_pair_and_packing_gives_the_same() -> None:
    settings = DPOSettings(beta=0.1, label_smoothing=0.0, ipo=False, nll_loss_coef=0.0)
    padded = DPOTask(_policy(), None, None, _policy(), CPU, PAD, False, settings)  # type: ignore[arg-type]
    loss = padded.micro_loss(PAIRS, num_tokens=3, num_seqs=3)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)  # policy == reference: every log-ratio is 0
    summary = padded.summary(padded.tally.take(), evaluation=False)
    assert summary["margin"] == 0.0 and summary["acc"] == 0.0
    trained = _policy()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p, generator=None))
    a = DPOTask(trained, None, None, _policy(), CPU, PAD, False, settings)  # type: ignore[arg-type]
    b = DPOTask(trained, None, None, _policy(), CPU, PAD, True, settings)  # type: ignore[arg-type]
    torch.testing.assert_close(b.micro_loss(PAIRS, 3, 3), a.micro_loss(PAIRS, 3, 3), rtol=1e-5, atol=1e-6)


def test_reward_model_scores_the_last_token_and_saves_openrlhf_statistics() -> None:
    source = PretrainedConfig(attn_implementation="sdpa")
    hf = scalar_model_from(None, source, 3, torch.float32)
    init_score_head(hf, 3)
    model = ScalarHeadModel(hf)
    task = RewardModelTask(model, None, None, CPU, PAD, False, "sigmoid", False)  # type: ignore[arg-type]
    packed = RewardModelTask(model, None, None, CPU, PAD, True, "sigmoid", False)  # type: ignore[arg-type]
    chosen, rejected = task._scores(PAIRS)
    c2, r2 = packed._scores(PAIRS)
    torch.testing.assert_close(c2, chosen, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r2, rejected, rtol=1e-5, atol=1e-6)
    by_hand = model(torch.tensor([[5, 6, 7, 8, 9]]), torch.ones(1, 5, dtype=torch.long))[0, -1]
    assert chosen[0].item() == pytest.approx(by_hand.item(), rel=1e-5)
    task.score(PAIRS)
    summary = task.summary(task.tally.take(), evaluation=True)
    rewards = torch.cat([chosen, rejected]).double()
    assert summary["reward_mean"] == pytest.approx(rewards.mean().item(), rel=1e-6)
    assert summary["reward_std"] == pytest.approx(rewards.std(unbiased=True).item(), rel=1e-5)  # OpenRLHF: torch.std
    assert task.reward_stats == (summary["reward_mean"], summary["reward_std"])
    expected = torch.nn.functional.softplus(rejected - chosen).mean().item()
    assert summary["loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("packing", [False, True])
def test_sft_on_a_moe_policy_adds_transformers_load_balancing_loss_and_reports_it(packing) -> None:
    """--aux_loss_coef in rlrun.sft (OpenRLHF's train_sft flag): the micro-batch loss is the NLL plus coef x the
    forward's load-balancing loss, which is transformers' own (output_router_logits over the rows' real tokens),
    weighted by the micro-batch's share of the batch's tokens; the summary reports moe/aux_loss and
    moe/max_expert_load."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        router_aux_loss_coef=1.0)).float()
    plain = SFTTask(model, None, None, CPU, PAD, packing=packing)  # type: ignore[arg-type]
    coef = 0.5
    with_aux = SFTTask(model, None, None, CPU, PAD, packing=packing, aux_loss_coef=coef)  # type: ignore[arg-type]
    tokens = sum(plain.loss_tokens(c) for c in COMPLETIONS)
    nll = plain.micro_loss(COMPLETIONS, num_tokens=tokens, num_seqs=3)
    both = with_aux.micro_loss(COMPLETIONS, num_tokens=2 * tokens, num_seqs=3)  # half of a batch twice as large
    batch = sequences_batch([c.prompt for c in COMPLETIONS], [c.response for c in COMPLETIONS], PAD)
    with torch.no_grad():
        hf = model(batch.sequences, attention_mask=batch.attention_mask, output_router_logits=True).aux_loss
    torch.testing.assert_close(both, nll / 2 + coef * hf * 0.5, rtol=1e-5, atol=1e-6)
    numbers = with_aux.summary(with_aux.tally.take(), evaluation=False)
    assert numbers["moe/aux_loss"] == pytest.approx(hf.item(), rel=1e-5) and 1 / 8 <= numbers["moe/max_expert_load"] <= 1
    both.backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in
               (m.mlp.gate for m in model.model.layers))


def test_packed_rows_attend_sequence_by_sequence_and_give_the_padded_numbers() -> None:
    """--packing_samples in rlrun.sft / rlrun.rm / rlrun.dpo: an sdpa text model's attention is switched so each packed
    sequence attends by itself (one row, no [S, S] mask), as in rlrun.ppo; the losses and scores equal the padded ones."""
    from rlrun.strategies.ulysses import ULYSSES
    from rlrun.supervised.assembly import BuildContext

    ctx = BuildContext(None, CPU, 0, PAD, packing=True)  # type: ignore[arg-type]  # no group is used
    padded_sft = SFTTask(_policy(), None, None, CPU, PAD, packing=False)  # type: ignore[arg-type]
    by_sequence = ctx.ulysses(_policy())
    assert by_sequence.config._attn_implementation == ULYSSES
    packed_sft = SFTTask(by_sequence, None, None, CPU, PAD, packing=True)  # type: ignore[arg-type]
    torch.testing.assert_close(packed_sft.micro_loss(COMPLETIONS, 8, 3), padded_sft.micro_loss(COMPLETIONS, 8, 3),
                               rtol=1e-5, atol=1e-6)
    settings = DPOSettings(beta=0.1, label_smoothing=0.0, ipo=False, nll_loss_coef=0.0)
    trained = _policy()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p))
    padded_dpo = DPOTask(trained, None, None, _policy(), CPU, PAD, False, settings)  # type: ignore[arg-type]
    want = padded_dpo.micro_loss(PAIRS, 3, 3)
    packed_dpo = DPOTask(ctx.ulysses(trained), None, None, ctx.ulysses(_policy()), CPU, PAD, True,  # type: ignore[arg-type]
                         settings)
    torch.testing.assert_close(packed_dpo.micro_loss(PAIRS, 3, 3), want, rtol=1e-5, atol=1e-6)
    hf = scalar_model_from(None, PretrainedConfig(attn_implementation="sdpa"), 3, torch.float32)
    init_score_head(hf, 3)
    chosen, rejected = RewardModelTask(ScalarHeadModel(hf), None, None, CPU, PAD, False, "sigmoid",  # type: ignore[arg-type]
                                       False)._scores(PAIRS)
    rm = ctx.ulysses(ScalarHeadModel(hf))
    c2, r2 = RewardModelTask(rm, None, None, CPU, PAD, True, "sigmoid", False)._scores(PAIRS)  # type: ignore[arg-type]
    torch.testing.assert_close(c2, chosen, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r2, rejected, rtol=1e-5, atol=1e-6)
    assert hf.config._attn_implementation == ULYSSES
