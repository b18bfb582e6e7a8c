"""Supervised samples as rollout-shaped batches, so the PPO roles' forward passes (padded or packed,
rlrun.roles.forward) score them unchanged: a row is `[left pad | prompt | response | right pad]`."""

from __future__ import annotations

from typing import Sequence

from rlrun.data.rollout import RolloutBatch, pack_rows, unpack_rows


def sequences_batch(prompts: Sequence[list[int]], responses: Sequence[list[int]], pad_id: int) -> RolloutBatch:
    """b (prompt ids, response ids) pairs -> RolloutBatch [b, p + r], action_mask [b, r] = the response tokens.

    A response can only be scored from a token before it: a row with an empty prompt (continued pretraining,
    pairs without a prompt) takes its first response token as its prompt, which leaves that token out of
    the loss as OpenRLHF's shifted labels do."""
    firsts: list[list[int]] = []
    rests: list[list[int]] = []
    for prompt, response in zip(prompts, responses):
        if not prompt:
            prompt, response = response[:1], response[1:]
        firsts.append(list(prompt))
        rests.append(list(response))
    width_p = max(len(p) for p in firsts)
    width_r = max(1, max(len(r) for r in rests))
    return unpack_rows(pack_rows(firsts, rests, width_p, width_r, pad_id), width_p)
