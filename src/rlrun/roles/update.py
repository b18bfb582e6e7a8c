"""The optimisation loop shared by the trainable roles (actor, critic).

Each global mini-batch is split evenly over the role's data-parallel ranks and then into
micro-batches; losses are normalised by the WHOLE mini-batch's token/sequence count (divided by
the ranks, since the gradient reduction averages over them), so gradient accumulation and data
parallelism give the same gradient as one big batch. That holds for any split, so --dynamic_batch
(rlrun.data.batching) deals rows to ranks by length and forms micro-batches of uneven sizes by
tokens with the same normalisation: every micro-batch's loss is its tokens' (or sequences') share of the whole.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from rlrun.data.batching import RowLengths, TokenBudget, balanced_shards, shard
from rlrun.runtime.errors import RlrunError
from rlrun.strategies.base import GradClipper, StepOps, TorchSteps

# ---- optimizer ---------------------------------------------------------------------------------------------------
# Optimizer and warmup + cosine LR schedule for the trainable roles.

# Device types whose AdamW has a fused (one kernel over all tensors) implementation. On CPU torch's
# default is a per-tensor Python loop: 7x slower than fused on a 50M-parameter step (DEEPSPEED.md 2e).
_FUSED_DEVICE_TYPES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu"})


def adam_implementation(params: Sequence[torch.Tensor]) -> dict[str, bool]:
    """The AdamW kwargs for these parameters: {"fused": True} when every one is a floating-point tensor
    (plain or an FSDP2 DTensor, which dispatches the fused kernel on its local shard) on a device with a
    fused kernel; otherwise {"foreach": True}, the multi-tensor path, which any device runs."""
    fused = bool(params) and all(p.is_floating_point() and p.device.type in _FUSED_DEVICE_TYPES for p in params)
    return {"fused": True} if fused else {"foreach": True}


def make_optimizer(
    model: nn.Module, lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, **adam_implementation(params))


def warmup_cosine(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float, min_lr_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over ceil(ratio * total) steps, then cosine decay to min_lr_ratio * lr."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# rows (global indices of one micro-batch), num_tokens, num_seqs -> (loss, stats: tensors or numbers)
MicroLoss = Callable[[torch.Tensor, float, float], tuple[torch.Tensor, Mapping[str, torch.Tensor | float]]]

# Stats a micro_loss may report that are summed over the micro-batches rather than averaged: token positions fed to
# the forward and real tokens among them; run() reports them as padded_token_frac.
FED_TOKENS, REAL_TOKENS = "fed_tokens", "real_tokens"

# Stats that are a micro-batch's share of its mini-batch's value (normalised by the whole mini-batch's tokens or
# sequences, as the loss is): summed over a mini-batch's micro-batches, then averaged over the mini-batches, so the
# logged loss is the mini-batch's loss whatever the micro-batch size (as OpenRLHF's per-micro-batch means are).
LOSS_SHARES = frozenset({"policy_loss", "kl_loss", "entropy", "value_loss", "distill_loss"})


@dataclass
class Updater:
    model: nn.Module
    strategy: GradClipper
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    max_norm: float
    micro_batch: int
    dp_rank: int
    dp_size: int
    max_nonfinite_in_a_row: int = 10  # --max_skipped_steps: this many skipped steps in a row fail the run
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite gradient, over the run
    nonfinite_in_a_row: int = 0  # consecutive skipped steps, reset by every finite one
    # backward / clip / step: plain autograd + optimizer (FSDP2), or the strategy's engine (DeepSpeed)
    ops: StepOps = field(default_factory=TorchSteps)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the loop besides the optimizer's state: the LR schedule and the skip count."""
        sched = {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}
        return {"scheduler": sched, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the schedule where the checkpoint left it, at THIS run's learning rate: the stored schedule
        carries the saving run's base rate, which would otherwise silently override a changed --learning_rate.
        With an unchanged rate nothing is touched (an exact resume stays exact)."""
        configured = list(self.scheduler.base_lrs)  # set from the config when the scheduler was built
        sched = dict(state["scheduler"])
        sched["lr_lambdas"] = [None] * len(self.optimizer.param_groups)
        self.scheduler.load_state_dict(sched)
        if list(self.scheduler.base_lrs) != configured:
            step = self.scheduler.last_epoch
            factors = [fn(step) for fn in self.scheduler.lr_lambdas]  # type: ignore[attr-defined]
            lrs = [base * factor for base, factor in zip(configured, factors)]
            self.scheduler.base_lrs = configured
            for group, base, lr in zip(self.optimizer.param_groups, configured, lrs):
                group["initial_lr"], group["lr"] = base, lr
            self.scheduler._last_lr = lrs  # what get_last_lr() reports (the logged lr)
        self.skipped_steps = int(state["skipped_steps"])

    def micro_batches(
        self, rows: torch.Tensor, budget: TokenBudget | None = None, lengths: RowLengths | None = None
    ) -> list[torch.Tensor]:
        """[n] global rows of one mini-batch -> this rank's micro-batches of global rows. Fixed: the rank's
        contiguous share in --micro_train_batch_size pieces. With a token budget (lengths: of every row of the
        batch): a length-balanced share in micro-batches by tokens, as many as on the role's other ranks
        (collective)."""
        if budget is None:
            mine = rows[shard(len(rows), self.dp_size, self.dp_rank)]
            return [mine[start : start + self.micro_batch] for start in range(0, len(mine), self.micro_batch)]
        if lengths is None:
            raise ValueError("a token budget needs the rows' lengths")
        share = balanced_shards(lengths.rows(rows).totals(), self.dp_size)[self.dp_rank]
        mine = rows[torch.tensor(share, dtype=torch.long)]
        return [mine[part] for part in budget.split(lengths.rows(mine))]

    def run(
        self,
        minibatches: list[torch.Tensor],
        token_mask: torch.Tensor,
        micro_loss: MicroLoss,
        budget: TokenBudget | None = None,
        lengths: RowLengths | None = None,
    ) -> dict[str, float]:
        """token_mask: [B, R] response mask of the full batch; budget/lengths: --dynamic_batch (micro_batches).
        Returns stats averaged over steps (LOSS_SHARES: each step's sum over its micro-batches), and padded_token_frac
        over all of them when micro_loss reports tokens."""
        self.model.train()
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        for rows in minibatches:
            num_tokens = float(token_mask[rows].sum()) / self.dp_size
            # Sequences with no response token left (groups removed by --dynamic_filtering) are not samples
            # of this update, as in OpenRLHF's loss normalisation; this keeps seq-mean modes exact too.
            num_seqs = float((token_mask[rows].sum(-1) > 0).sum()) / self.dp_size
            parts = self.micro_batches(rows, budget, lengths)
            self.ops.zero_grad(self.optimizer)
            shares: dict[str, float] = defaultdict(float)
            for k, part in enumerate(parts):
                loss, stats = micro_loss(part, num_tokens, num_seqs)
                self.ops.backward(loss, last_micro=k == len(parts) - 1)
                for key, value in stats.items():
                    if key in LOSS_SHARES:
                        shares[key] += float(value)
                        continue
                    sums[key] += float(value)
                    counts[key] += key not in (FED_TOKENS, REAL_TOKENS)
            for key, value in shares.items():
                sums[key] += value
                counts[key] += 1
            if budget is not None:  # uneven from step to step: logged (per optimizer step, this rank)
                sums["micro_batches"] += len(parts)
                counts["micro_batches"] += 1
            grad_norm = self.ops.clip_and_step(self.model, self.optimizer, self.strategy, self.max_norm)
            if math.isfinite(grad_norm):
                self.nonfinite_in_a_row = 0
            else:  # clip_and_step left the weights untouched: a NaN/inf gradient must never reach them
                self.skipped_steps += 1
                self.nonfinite_in_a_row += 1
                # The norm is global over the role's ranks, so every rank of the role stops at the same step.
                if self.nonfinite_in_a_row >= self.max_nonfinite_in_a_row:
                    raise RlrunError(
                        f"non-finite gradient for {self.nonfinite_in_a_row} optimizer steps in a row (gradient norm "
                        f"{grad_norm}; {self.skipped_steps} skipped in total); the weights were not updated by them. "
                        "Lower the learning rate, check the rewards and inputs, or raise --max_skipped_steps."
                    )
            with warnings.catch_warnings():  # after a skipped step torch warns that the schedule runs ahead; it should
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
                self.scheduler.step()
            sums["grad_norm"] += grad_norm if math.isfinite(grad_norm) else 0.0
            counts["grad_norm"] += 1
        fed, real = sums.pop(FED_TOKENS, 0.0), sums.pop(REAL_TOKENS, 0.0)
        out = {k: sums[k] / counts[k] for k in sums}
        if fed:  # this rank's padding over the update (every rank's micro-batches are alike by construction)
            out["padded_token_frac"] = 1.0 - real / fed
        out["lr"] = cast(float, self.scheduler.get_last_lr()[0])  # make_optimizer's lr: a float
        out["skipped_steps"] = float(self.skipped_steps)
        return out
