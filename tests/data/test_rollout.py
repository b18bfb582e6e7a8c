"""Pure tensor plumbing: rollout packing, result slots, row sharding, running moments."""

from __future__ import annotations

import pytest
import torch

from rlrun.algo.algorithms import RunningMoments
from rlrun.data.batching import derive_seed, minibatch_order, shard
from rlrun.data.rollout import pack_slots, slot_layout, unpack_slots
from rlrun.data.rollout import pack_rows, response_tokens, unpack_rows

PAD = 99


def test_pack_unpack_trims_to_longest_real_prompt_and_response():
    prompts = [[1, 2, 3], [4]]
    responses = [[5], [6, 7, 8, 9]]
    packed = pack_rows(prompts, responses, prompt_width=6, response_width=5, pad_id=PAD)
    assert packed.shape == (2, 6 + 5 + 2)
    batch = unpack_rows(packed, prompt_width=6)
    # trimmed: prompt width 3 (left-padded), response width 4 (right-padded)
    assert batch.sequences.tolist() == [[1, 2, 3, 5, PAD, PAD, PAD], [PAD, PAD, 4, 6, 7, 8, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1]]
    assert batch.action_mask.tolist() == [[1, 0, 0, 0], [1, 1, 1, 1]]
    assert batch.prompt_len.tolist() == [3, 1] and batch.response_len.tolist() == [1, 4]
    assert response_tokens(batch) == responses


def test_pack_rejects_rows_wider_than_the_wire():
    with pytest.raises(ValueError, match="row 0"):
        pack_rows([[1] * 7], [[2]], prompt_width=6, response_width=5, pad_id=PAD)


def test_empty_response_keeps_one_masked_column():
    batch = unpack_rows(pack_rows([[1]], [[]], 4, 3, PAD), prompt_width=4)
    assert batch.response_width == 1 and batch.action_mask.tolist() == [[0]]


def test_result_slots_round_trip_through_a_simulated_all_gather():
    """4 ranks: actor on [0,1], ref on [2], reward model on [3]; B=4 rows, R=2."""
    B, R = 4, 2
    plan = slot_layout(B, {"old_log_probs": R, "ref_log_probs": R, "scores": 1},
                     {"old_log_probs": (0, 1), "ref_log_probs": (2,), "scores": (3,)})
    assert plan.total == 2 * R + 4 * R + 4
    full_logp = torch.arange(B * R, dtype=torch.float32).view(B, R)
    full_ref = -full_logp
    full_scores = torch.tensor([0.5, 1.5, 2.5, 3.5])
    per_rank = {
        0: {"old_log_probs": full_logp[0:2]},
        1: {"old_log_probs": full_logp[2:4]},
        2: {"ref_log_probs": full_ref},
        3: {"scores": full_scores.view(B, 1)},
    }
    gathered = torch.stack([pack_slots(plan, r, per_rank[r]) for r in range(4)])
    out = unpack_slots(plan, gathered)
    assert torch.equal(out["old_log_probs"], full_logp)
    assert torch.equal(out["ref_log_probs"], full_ref)
    assert torch.equal(out["scores"], full_scores)


def test_shard_and_minibatch_order():
    assert [shard(12, 3, i) for i in range(3)] == [slice(0, 4), slice(4, 8), slice(8, 12)]
    a = minibatch_order(8, 4, seed=1)
    assert sorted(torch.cat(a).tolist()) == list(range(8)) and [len(x) for x in a] == [4, 4]
    assert [x.tolist() for x in a] == [x.tolist() for x in minibatch_order(8, 4, seed=1)]
    assert [x.tolist() for x in a] != [x.tolist() for x in minibatch_order(8, 4, seed=2)]


def test_derive_seed_is_stable_and_distinct():
    assert derive_seed(42, "generate", 3, 1) == derive_seed(42, "generate", 3, 1)
    assert derive_seed(42, "generate", 3, 1) != derive_seed(42, "generate", 3, 2)
    assert 0 <= derive_seed("x") < 2**63


def test_running_moments_match_the_whole_sample():
    x = torch.tensor([1.0, 2.0, 3.0, 10.0, -4.0, 0.5])
    m = RunningMoments()
    m.update(x[:2])
    m.update(x[2:5])
    m.update(x[5:])
    assert m.count == 6
    assert m.mean == pytest.approx(float(x.mean()))
    assert m.std == pytest.approx(float(x.std(unbiased=False)))
    assert torch.allclose(m.normalize(x).mean(), torch.tensor(0.0), atol=1e-6)
