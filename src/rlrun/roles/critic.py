"""The critic (per-token value estimates and their regression loss) and the reward model (a scalar head scoring
the last token): the roles whose models end in a scalar head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlrun.algo.losses import LossAggMode, value_loss
from rlrun.data.batching import TokenBudget, trim_padding
from rlrun.data.rollout import RolloutBatch
from rlrun.launch.groups import SequenceParallel
from rlrun.roles.forward import fed_tokens, over_micro_batches, sequence_scores, token_values
from rlrun.roles.update import FED_TOKENS, REAL_TOKENS, MicroLoss, Updater


@dataclass
class ValueData:
    """Full-batch inputs, [B, R]."""

    batch: RolloutBatch
    old_values: torch.Tensor
    returns: torch.Tensor


class Critic:
    def __init__(
        self,
        model: nn.Module,
        updater: Updater,
        value_clip: float | None,
        agg: LossAggMode,
        device: torch.device,
        packing: bool = False,
        sp: SequenceParallel | None = None,
    ) -> None:
        self.model = model
        self.packing = packing  # --packing_samples: forward on packed rows (rlrun.data.packing)
        self.sp = sp  # this rank's sequence-parallel group (rlrun.strategies.ulysses)
        self.updater = updater
        self.value_clip = value_clip
        self.agg = agg
        self.device = device

    def values(self, batch: RolloutBatch, micro_batch: int | TokenBudget) -> torch.Tensor:
        """[b, L] rollouts -> [b, R] values (micro_batch: rows, or a token budget)."""
        return over_micro_batches(
            self.model,
            batch,
            micro_batch,
            self.device,
            lambda p: token_values(self.model, p, packing=self.packing, sp=self.sp),
        )

    def loss(self, data: ValueData, budget: TokenBudget | None = None) -> MicroLoss:
        """The value loss of one update over `data`, for the critic's Updater: micro-batch rows -> (the loss, its
        stats). budget: --dynamic_batch micro-batches by tokens, each trimmed to its own longest prompt and response."""

        def micro_loss(
            rows: torch.Tensor, num_tokens: float, num_seqs: float
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor | int]]:
            part = data.batch.rows(rows)
            part = (trim_padding(part) if budget is not None else part).to(self.device)
            r = part.response_width  # the full batch's [B, R] targets cut to the part's columns
            values = token_values(self.model, part, packing=self.packing, sp=self.sp)
            loss, stats = value_loss(
                values,
                data.old_values[rows, :r].to(self.device),
                data.returns[rows, :r].to(self.device),
                part.action_mask,
                value_clip=self.value_clip,
                agg=self.agg,
                num_tokens=num_tokens,
                num_seqs=num_seqs,
            )
            return loss, {
                "value_loss": loss.detach(),
                **stats,
                FED_TOKENS: fed_tokens(self.model, part, self.packing, self.sp.size if self.sp else 1),
                REAL_TOKENS: int(part.attention_mask.sum()),
            }

        return micro_loss


# ---- the reward model --------------------------------------------------------------------------------------------
# Reward role backed by a reward model (a scalar head scoring the last token).


class RewardModel:
    def __init__(
        self, model: nn.Module, device: torch.device, packing: bool = False, sp: SequenceParallel | None = None
    ) -> None:
        self.model = model.eval()
        self.packing = packing  # --packing_samples: forward on packed rows (rlrun.data.packing)
        self.sp = sp  # this rank's sequence-parallel group (rlrun.strategies.ulysses)
        self.device = device

    def score(self, batch: RolloutBatch, micro_batch: int | TokenBudget) -> torch.Tensor:
        """[b, L] rollouts -> [b] scores (micro_batch: rows, or a token budget)."""
        return over_micro_batches(
            self.model,
            batch,
            micro_batch,
            self.device,
            lambda p: sequence_scores(self.model, p, packing=self.packing, sp=self.sp),
        )
