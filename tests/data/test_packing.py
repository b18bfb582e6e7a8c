"""rlrun.data.packing: which sequences share a row, and where every token and output goes (hand-computed layouts)."""

from __future__ import annotations

import pytest
import torch

from rlrun.data.packing import assign_rows, pack_batch
from rlrun.data.rollout import pack_rows, unpack_rows

PAD = 99


def _batch():
    # prompt lengths 3, 2, 5, 1; response lengths 4, 1, 2, 0 -> sequence lengths 7, 3, 7, 1.
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11]]
    responses = [[20, 21, 22, 23], [24], [25, 26], []]
    return unpack_rows(pack_rows(prompts, responses, 8, 6, PAD), 8)  # trimmed to p = 5, r = 4: width 9


def test_assign_rows_first_fit_decreasing():
    # Sorted by length (ties by index): 0(7), 2(7), 1(3), 3(1). Capacity 9: 0 opens row 0, 2 opens row 1,
    # 1 does not fit row 0 (7+3 > 9) nor row 1 -> row 2; 3 fits row 0 (7+1).
    assert assign_rows([7, 3, 7, 1], 9) == [[0, 3], [2], [1]]
    assert assign_rows([7, 3, 7, 1], 10) == [[0, 1], [2, 3]]
    assert assign_rows([7, 3, 7, 1], None) == [[0, 2, 1, 3]]
    assert assign_rows([2, 0, 2], 4) == [[0, 2]]  # a zero-length sequence is not placed
    with pytest.raises(ValueError, match="sequence 1 has 5 tokens, more than the packing capacity 4"):
        assign_rows([2, 5], 4)


def test_pack_batch_layout():
    packed = pack_batch(_batch(), capacity=9, pad_id=0)
    # Rows [[0, 3], [2], [1]]; width = the fullest row (8 tokens). Tails are padding whose positions restart.
    assert packed.input_ids.tolist() == [[1, 2, 3, 20, 21, 22, 23, 11],
                                         [6, 7, 8, 9, 10, 25, 26, 0],
                                         [4, 5, 24, 0, 0, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 0],
                                            [0, 1, 2, 3, 4, 5, 6, 0],
                                            [0, 1, 2, 0, 1, 2, 3, 4]]
    # The token before each response token, as flat index row * 8 + col, ascending:
    # seq 0 response at cols 3..6 -> predecessors 2..5; seq 2 at row 1 cols 5, 6 -> 12, 13; seq 1 at row 2 col 2 -> 17.
    assert packed.pred_index.tolist() == [2, 3, 4, 5, 12, 13, 17]
    assert packed.out_row.tolist() == [0, 0, 0, 0, 2, 2, 1]
    assert packed.out_col.tolist() == [0, 1, 2, 3, 0, 1, 0]
    assert packed.targets().tolist() == [20, 21, 22, 23, 25, 26, 24]
    assert packed.last_index.tolist() == [6, 18, 14, 7]  # seq 3 is the prompt-only token at row 0 col 7
    assert packed.keep_mask().nonzero().tolist() == [[0, 2], [0, 3], [0, 4], [0, 5], [1, 4], [1, 5], [2, 1]]


def test_pack_batch_one_row_and_scatter():
    packed = pack_batch(_batch(), capacity=None)
    assert packed.input_ids.shape == (1, 18)
    assert packed.input_ids[0].tolist() == [1, 2, 3, 20, 21, 22, 23, 6, 7, 8, 9, 10, 25, 26, 4, 5, 24, 11]
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0]
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])  # in pred_index order
    assert packed.scatter(values).tolist() == [[1.0, 2.0, 3.0, 4.0],
                                               [7.0, 0.0, 0.0, 0.0],
                                               [5.0, 6.0, 0.0, 0.0],
                                               [0.0, 0.0, 0.0, 0.0]]


def test_scatter_is_differentiable():
    packed = pack_batch(_batch(), capacity=9)
    values = torch.arange(7, dtype=torch.float32, requires_grad=True)
    (packed.scatter(values) * torch.arange(16, dtype=torch.float32).view(4, 4)).sum().backward()
    # d/dv_k = weight at (out_row_k, out_col_k) = 4 * row + col
    assert values.grad.tolist() == [0.0, 1.0, 2.0, 3.0, 8.0, 9.0, 4.0]


def test_empty_prompt_drops_the_first_response_token():
    batch = unpack_rows(pack_rows([[], [5]], [[7, 8], [9]], 2, 2, PAD), 2)
    packed = pack_batch(batch, capacity=None)
    assert packed.input_ids[0].tolist() == [7, 8, 5, 9]
    assert packed.pred_index.tolist() == [0, 2]  # token 7 has no predecessor; 8 after 7, 9 after 5
    assert packed.out_row.tolist() == [0, 1] and packed.out_col.tolist() == [1, 0]
