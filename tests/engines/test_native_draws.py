"""The native engine's per-row draws (rlrun.engines.native.draws): a function of (seed, row, step) alone, uniform,
and turned into tokens by the inverse of the cumulative distribution, which never picks a token of probability 0."""

from __future__ import annotations

import torch

from rlrun.engines.native.draws import draw_tokens, uniform


def test_a_draw_depends_on_its_own_row_and_step_only() -> None:
    rows, steps = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 5, 5, 9])
    together = uniform(7, rows, steps)
    alone = torch.cat([uniform(7, rows[i : i + 1], steps[i : i + 1]) for i in range(4)])
    assert torch.equal(together, alone)
    assert torch.equal(uniform(7, rows.flip(0), steps.flip(0)), together.flip(0))  # order in the batch is irrelevant
    assert not torch.equal(uniform(8, rows, steps), together)  # the seed matters
    assert uniform(2**40 + 7, rows, steps).shape == (4,)  # 64-bit seeds fold in without overflow


def test_draws_are_uniform_and_uncorrelated_across_rows_and_steps() -> None:
    rows = torch.arange(200).repeat_interleave(500)
    steps = torch.arange(500).repeat(200)
    u = uniform(3, rows, steps)
    assert u.dtype == torch.float64 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert len(torch.unique(u)) == len(u)
    counts = torch.histc(u.float(), bins=20, min=0.0, max=1.0)
    expected = len(u) / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 60.0, chi2  # 19 degrees of freedom: p < 1e-5 above 50
    grid = u.view(200, 500)
    neighbours = torch.corrcoef(torch.stack([grid[:, :-1].flatten(), grid[:, 1:].flatten()]))[0, 1]
    across = torch.corrcoef(torch.stack([grid[:-1].flatten(), grid[1:].flatten()]))[0, 1]
    assert abs(float(neighbours)) < 0.02 and abs(float(across)) < 0.02


def test_inverse_cdf_by_hand() -> None:
    """probs [0.2, 0, 0.8]: cumulative [0.2, 0.2, 1.0]; a draw picks the first token whose cumulative exceeds it, so the
    zero-probability token 1 is never chosen, not even at the boundary 0.2."""
    probs = torch.tensor([[0.2, 0.0, 0.8]] * 5)
    draws = torch.tensor([0.0, 0.19, 0.2, 0.5, 1 - 2**-53], dtype=torch.float64)
    assert draw_tokens(probs, draws).tolist() == [0, 0, 2, 2, 2]
    unnormalised = torch.tensor([[1.0, 0.0, 3.0]])  # scaled by the row's total, not assumed to sum to 1
    assert draw_tokens(unnormalised, torch.tensor([0.24], dtype=torch.float64)).tolist() == [0]
    assert draw_tokens(unnormalised, torch.tensor([0.26], dtype=torch.float64)).tolist() == [2]


def test_tokens_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    n = 40_000
    tokens = draw_tokens(probs.expand(n, 5), uniform(11, torch.arange(n), torch.zeros(n, dtype=torch.long)))
    freq = torch.bincount(tokens, minlength=5).double() / n
    assert freq[4] == 0
    torch.testing.assert_close(freq, probs.double(), rtol=0, atol=0.01)
