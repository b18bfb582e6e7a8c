"""Which rows each rank handles: pure index arithmetic shared by every role."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from rlrun.data.rollout import RolloutBatch


def shard(num_rows: int, num_shards: int, index: int) -> slice:
    """Contiguous equal share `index` of `num_shards` (callers check divisibility up front)."""
    size = num_rows // num_shards
    return slice(index * size, (index + 1) * size)


def derive_seed(*parts: int | str) -> int:
    """A stable 63-bit seed from parts (Python's hash() is salted per process)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def minibatch_order(num_rows: int, mini_batch: int, seed: int) -> list[torch.Tensor]:
    """A shuffled split of range(num_rows) into mini-batches, identical on every rank."""
    perm = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed))
    return list(perm.split(mini_batch))


# ---- token budgets -----------------------------------------------------------------------------------------------
# Token-budget micro-batches (--dynamic_batch): which rows go into which forward pass, by length (pure index
# arithmetic on row lengths, no model; the one collective, agreeing on a count, is a callable handed in).
#
# With long-tailed response lengths a fixed --micro_train_batch_size pads every short row to the longest row of its
# micro-batch. Here rows are sorted by real length (prompt + response tokens) and packed into micro-batches whose
# padded size (rows x (longest prompt + longest response), the RolloutBatch layout) stays within a token budget, as
# verl's `rearrange_micro_batches` and OpenRLHF's dynamic batches do. With --packing_samples a micro-batch costs its
# real (packed) tokens instead. Rows are first dealt to the data-parallel ranks so that every rank gets the same
# number of rows and about the same number of tokens, and the number of micro-batches is raised to the largest of
# any rank of the role (FSDP and DeepSpeed need every rank to run the same number of forward/backward calls).


@dataclass(frozen=True)
class RowLengths:
    """Real token counts of the rows of a batch. prompt, response: [B] long (CPU)."""

    prompt: torch.Tensor
    response: torch.Tensor

    @classmethod
    def of(cls, batch: RolloutBatch) -> RowLengths:
        return cls(batch.prompt_len.cpu(), batch.response_len.cpu())

    def rows(self, index: torch.Tensor) -> RowLengths:
        return RowLengths(self.prompt[index], self.response[index])

    def totals(self) -> list[int]:
        """[B] real tokens per row (prompt + response)."""
        return (self.prompt + self.response).tolist()


def micro_batch_cost(prompt: list[int], response: list[int], packed: bool) -> int:
    """Tokens one forward over these rows feeds the model: rows x (longest prompt + longest response) for padded
    rows (prompts are left-padded, responses right-padded), or the sum of real tokens when packed."""
    if not prompt:
        return 0
    if packed:
        return sum(prompt) + sum(response)
    return len(prompt) * (max(prompt) + max(response))


def micro_batches_by_tokens(lengths: RowLengths, max_tokens: int, packed: bool) -> list[list[int]]:
    """Row indices of each micro-batch, every micro-batch costing at most `max_tokens` (micro_batch_cost).

    Rows are taken longest first and a micro-batch is closed when the next row would push it over the budget, so
    rows of similar length share a micro-batch (little padding) and the long tail costs few forward passes. Ties
    keep index order: the plan is the same on every rank that computes it."""
    p, r = lengths.prompt.tolist(), lengths.response.tolist()
    order = sorted(range(len(p)), key=lambda i: (-(p[i] + r[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if micro_batch_cost([p[i]], [r[i]], packed) > max_tokens:
            raise ValueError(
                f"row {i} has {p[i]} prompt + {r[i]} response tokens, more than the token budget "
                f"{max_tokens} of one micro-batch; raise --train_max_tokens_per_gpu / "
                "--rollout_max_tokens_per_gpu to at least --prompt_max_len + --generate_max_len"
            )
        grown = current + [i]
        if current and micro_batch_cost([p[j] for j in grown], [r[j] for j in grown], packed) > max_tokens:
            batches.append(current)
            grown = [i]
        current = grown
    if current:
        batches.append(current)
    return batches


def split_to_count(plan: list[list[int]], count: int, lengths: RowLengths, packed: bool) -> list[list[int]]:
    """`plan` with exactly `count` micro-batches (count >= len(plan)): the costliest micro-batch of two or more
    rows is halved until there are enough. Halves of a budget-respecting micro-batch respect it too.

    Every rank of a role has the same number of rows, and no rank plans more micro-batches than it has rows, so
    `count` (the largest plan of any rank) never exceeds the rows here; the error below is a broken invariant."""
    if count < len(plan):
        raise ValueError(f"cannot merge {len(plan)} micro-batches into {count}")
    out = [list(mb) for mb in plan]
    p, r = lengths.prompt.tolist(), lengths.response.tolist()
    while len(out) < count:
        splittable = [k for k, mb in enumerate(out) if len(mb) > 1]
        if not splittable:
            raise ValueError(
                f"{sum(map(len, out))} rows cannot fill {count} micro-batches (the largest count of a "
                "rank of this role): the role's ranks must hold the same number of rows"
            )
        k = max(
            splittable, key=lambda j: (micro_batch_cost([p[i] for i in out[j]], [r[i] for i in out[j]], packed), -j)
        )
        half = len(out[k]) // 2
        out[k : k + 1] = [out[k][:half], out[k][half:]]
    return out


def _alone(count: int) -> int:
    return count


@dataclass(frozen=True)
class TokenBudget:
    """--dynamic_batch on one role's data-parallel ranks: the most tokens per micro-batch, and how the ranks agree
    on one micro-batch count (the largest: a collective over the role's group; alone, the count itself)."""

    max_tokens: int
    packed: bool = False  # --packing_samples: a micro-batch costs its real tokens
    agree: Callable[[int], int] = field(default=_alone, compare=False)

    def split(self, lengths: RowLengths) -> list[torch.Tensor]:
        """[b] rows -> row indices (into `lengths`) of each micro-batch, as many micro-batches as every other rank
        of the role runs. Collective over the role (agree)."""
        plan = micro_batches_by_tokens(lengths, self.max_tokens, self.packed)
        count = self.agree(len(plan))
        return [torch.tensor(mb, dtype=torch.long) for mb in split_to_count(plan, count, lengths, self.packed)]


def balanced_shards(totals: list[int], num_shards: int) -> list[list[int]]:
    """Deal rows with these real token counts to `num_shards` data-parallel ranks: the same number of rows each
    (len(totals) divisible by num_shards, checked up front), about the same tokens each (longest first, each to the
    rank with the fewest tokens so far that still has room). Each shard's indices ascend; ties go to the lower rank.

    The loss is normalised by the whole mini-batch's token/sequence count, so which rank trains which row does not
    change the gradient: only how long each rank computes."""
    n = len(totals)
    if num_shards <= 0 or n % num_shards:
        raise ValueError(f"{n} rows do not split evenly over {num_shards} ranks")
    room = n // num_shards
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    load = [0] * num_shards
    for i in sorted(range(n), key=lambda i: (-totals[i], i)):
        s = min((k for k in range(num_shards) if len(shards[k]) < room), key=lambda k: (load[k], k))
        shards[s].append(i)
        load[s] += totals[i]
    return [sorted(s) for s in shards]


def balanced_order(lengths: RowLengths, num_shards: int) -> torch.Tensor:
    """[B] a permutation of the rows whose contiguous equal shards are balanced_shards (the scoring pass hands
    rank k the k-th contiguous shard)."""
    return torch.tensor([i for s in balanced_shards(lengths.totals(), num_shards) for i in s], dtype=torch.long)


def trim_padding(part: RolloutBatch) -> RolloutBatch:
    """[b, P + R] -> [b, p + r]: drop the prompt columns left of the longest prompt of these rows and the response
    columns right of their longest response (columns that are padding in every row). Positions come from the
    attention mask, so the real tokens' outputs are the same; per-token outputs are [b, r]: pad_responses."""
    R = part.response_width
    P = part.sequences.shape[1] - R
    p = int(part.prompt_len.max()) if len(part.prompt_len) else 0
    r = max(int(part.response_len.max()) if len(part.response_len) else 0, 1)
    cols = slice(P - p, P + r)
    return RolloutBatch(
        part.sequences[:, cols],
        part.attention_mask[:, cols],
        part.action_mask[:, :r],
        part.prompt_len,
        part.response_len,
        None if part.engine_log_probs is None else part.engine_log_probs[:, :r],
        part.vision,
        None if part.routing is None else part.routing[:, cols],
    )


def pad_responses(values: torch.Tensor, width: int) -> torch.Tensor:
    """[b, r] per-token values -> [b, width], 0 on the added columns; [b] per-row values unchanged."""
    return values if values.dim() == 1 else F.pad(values, (0, width - values.shape[1]))


def restore_order(parts: list[torch.Tensor], outputs: list[torch.Tensor]) -> torch.Tensor:
    """Per micro-batch row indices [b_k] and outputs [b_k, ...] -> [sum b_k, ...] with row i at index i."""
    rows = torch.cat(parts)
    values = torch.cat(outputs)
    out = values.new_empty(values.shape)
    out[rows] = values
    return out


def padded_tokens(lengths: RowLengths, micro_batches: list[list[int]]) -> tuple[int, int]:
    """(padded tokens, tokens fed) of padded forwards over these micro-batches, each trimmed to its own rows."""
    p, r = lengths.prompt.tolist(), lengths.response.tolist()
    fed = sum(micro_batch_cost([p[i] for i in mb], [r[i] for i in mb], False) for mb in micro_batches)
    real = sum(p[i] + r[i] for mb in micro_batches for i in mb)
    return fed - real, fed


# ---- seeding -----------------------------------------------------------------------------------------------------
# Seeding every random number generator a run draws from (Python, NumPy, torch on every device).


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
