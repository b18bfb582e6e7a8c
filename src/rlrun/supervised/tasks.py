"""What a supervised trainer (SFT, reward model, DPO) plugs into the shared loop (rlrun.supervised.loop)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from rlrun.data.rollout import RolloutBatch, pack_rows, unpack_rows
from rlrun.launch.groups import SequenceParallel
from rlrun.models.loading import ScalarHeadModel
from rlrun.models.lora import adapters_disabled
from rlrun.models.moe import RoutingRun, RoutingShape, routing_shape
from rlrun.roles.export import save_causal_lm, save_scalar_model
from rlrun.roles.forward import policy_log_probs, sequence_scores
from rlrun.strategies.base import Strategy
from rlrun.supervised.datasets import Completion, Preference
from rlrun.supervised.losses import dpo_loss, nll_term, pairwise_rm_loss, sequence_log_prob, token_nll

S = TypeVar("S")


class Tally:
    """Sums over the samples a rank has seen since the last `take()`; summed over ranks by the loop, so every
    logged metric is exact over the global batch whatever the ranks and micro-batches."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)

    def add(self, **values: float | torch.Tensor) -> None:
        for key, value in values.items():
            self.sums[key] += float(value)

    def take(self) -> dict[str, float]:
        out, self.sums = dict(self.sums), defaultdict(float)
        return out


class Task(Protocol, Generic[S]):
    """One trainer's model(s) and loss. `model` is the trained (wrapped) model, stepped by the loop's Updater."""

    name: str  # "sft" | "rm" | "dpo": log and tracker names
    tally_keys: tuple[str, ...]  # every key `tally` may hold (a rank with no samples still sums zeros)

    @property
    def model(self) -> nn.Module: ...  # read-only, so a task may declare the model it wraps (a ScalarHeadModel)

    optimizer: torch.optim.Optimizer
    strategy: Strategy
    tally: Tally

    def loss_tokens(self, sample: S) -> int:
        """Tokens of `sample` a token-mean loss averages over (>= 1)."""
        ...

    def micro_loss(self, samples: list[S], num_tokens: float, num_seqs: float) -> torch.Tensor:
        """The micro-batch's share of the global batch loss (normalised by the batch's tokens or samples per
        rank, see rlrun.roles.update); records its metric sums in `tally`."""
        ...

    def score(self, samples: list[S]) -> None:
        """Evaluation: record the metric sums of `samples` in `tally` (no gradient)."""
        ...

    def summary(self, sums: dict[str, float], *, evaluation: bool) -> dict[str, float]:
        """Metrics from tallies summed over every rank (of a training step, or of an evaluation pass)."""
        ...

    def save(
        self,
        path: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        is_writer: bool,
        allow_nonfinite: bool = False,
        merged: bool = False,
    ) -> None:
        """The trained model in HF format (collective over the ranks); with LoRA the adapter directory, and with
        `merged` (--save_merged) the merged model in <path>/merged too."""
        ...


# ---- batches -----------------------------------------------------------------------------------------------------
# Supervised samples as rollout-shaped batches, so the PPO roles' forward passes (padded or packed,
# rlrun.roles.forward) score them unchanged: a row is `[left pad | prompt | response | right pad]`.


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


# ---- SFT ---------------------------------------------------------------------------------------------------------
# SFT: next-token NLL on the response tokens (the prompt is context only), a token mean over the global batch.


@dataclass
class SFTTask:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    strategy: Strategy
    device: torch.device
    pad_id: int
    packing: bool
    sp: SequenceParallel | None = None  # the rank's sequence-parallel block: it runs a token shard of each row
    aux_loss_coef: float = 0.0  # --aux_loss_coef on a MoE policy: the load-balancing loss's weight
    name: str = "sft"
    tally_keys: tuple[str, ...] = ("nll", "tokens", "aux_loss", "max_expert_load", "moe_tokens")
    tally: Tally = field(default_factory=Tally)
    routing: RoutingShape | None = field(init=False)  # None: a dense policy

    def __post_init__(self) -> None:
        self.routing = routing_shape(self.model)

    def loss_tokens(self, sample: Completion) -> int:
        # sequences_batch moves the first token of a prompt-less sample into the prompt
        return max(1, len(sample.response) - (0 if sample.prompt else 1))

    def _nll(self, samples: list[Completion]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """[b] summed NLL of each response, [b, r] response mask, and on a MoE policy the forward's load-balancing
        loss (with grad; its numbers tallied, weighted by the response tokens)."""
        batch = sequences_batch([s.prompt for s in samples], [s.response for s in samples], self.pad_id).to(self.device)
        moe = None if self.routing is None else RoutingRun(replay=False)
        log_probs, _ = policy_log_probs(self.model, batch, 1.0, packing=self.packing, sp=self.sp, moe=moe)
        nll, mask = token_nll(log_probs, batch.action_mask), batch.action_mask
        if moe is None or self.routing is None:
            return nll, mask, None
        aux, numbers = moe.metrics(self.routing.top_k)
        tokens = float(mask.sum())
        self.tally.add(
            aux_loss=numbers["moe/aux_loss"] * tokens,
            max_expert_load=numbers["moe/max_expert_load"] * tokens,
            moe_tokens=tokens,
        )
        return nll, mask, aux

    def micro_loss(self, samples: list[Completion], num_tokens: float, num_seqs: float) -> torch.Tensor:
        nll, mask, aux = self._nll(samples)
        self.tally.add(nll=nll.detach().sum(), tokens=mask.sum())
        loss = nll.sum() / num_tokens
        if aux is not None and self.aux_loss_coef > 0:  # each micro-batch by its share of the batch's tokens
            loss = loss + self.aux_loss_coef * aux * (mask.sum() / num_tokens)
        return loss

    def score(self, samples: list[Completion]) -> None:
        nll, mask, _ = self._nll(samples)
        self.tally.add(nll=nll.sum(), tokens=mask.sum())

    def summary(self, sums: dict[str, float], *, evaluation: bool) -> dict[str, float]:
        loss = sums["nll"] / max(sums["tokens"], 1.0)
        out = {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "tokens": sums["tokens"]}
        if sums.get("moe_tokens", 0.0) > 0:
            moe = sums["moe_tokens"]
            out |= {"moe/aux_loss": sums["aux_loss"] / moe, "moe/max_expert_load": sums["max_expert_load"] / moe}
        return out

    def save(
        self,
        path: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        is_writer: bool,
        allow_nonfinite: bool = False,
        merged: bool = False,
    ) -> None:
        save_causal_lm(
            self.model,
            tokenizer,
            path,
            is_writer=is_writer,
            strategy=self.strategy,
            allow_nonfinite=allow_nonfinite,
            merged=merged,
        )


# ---- reward model ------------------------------------------------------------------------------------------------
# Reward model: a scalar head read at each sequence's last token, trained on preference pairs
# (chosen above rejected); saved as a sequence-classification model `rlrun.ppo --reward_pretrain` loads,
# with the reward mean/std OpenRLHF's --normalize_reward reads from its config.


@dataclass
class RewardModelTask:
    model: ScalarHeadModel  # wrapped by the strategy
    optimizer: torch.optim.Optimizer
    strategy: Strategy
    device: torch.device
    pad_id: int
    packing: bool
    loss_kind: Literal["sigmoid", "logexpsigmoid"]
    margin_loss: bool
    sp: SequenceParallel | None = None
    name: str = "rm"
    tally_keys: tuple[str, ...] = ("loss", "correct", "chosen", "rejected", "pairs", "reward_sq")
    tally: Tally = field(default_factory=Tally)
    # (mean, std) of the rewards of the last evaluation, chosen and rejected sequences alike: saved in config.json
    reward_stats: tuple[float, float] | None = None

    def loss_tokens(self, sample: Preference) -> int:
        return 1  # the loss is a mean over pairs

    def _scores(self, samples: list[Preference]) -> tuple[torch.Tensor, torch.Tensor]:
        """[b] chosen and [b] rejected rewards: one forward over 2b rows (chosen rows first)."""
        batch = sequences_batch(
            [s.prompt for s in samples] * 2, [s.chosen for s in samples] + [s.rejected for s in samples], self.pad_id
        ).to(self.device)
        scores = sequence_scores(self.model, batch, packing=self.packing, sp=self.sp)
        return scores[: len(samples)], scores[len(samples) :]

    def _record(self, chosen: torch.Tensor, rejected: torch.Tensor, losses: torch.Tensor) -> None:
        chosen, rejected = chosen.detach().float(), rejected.detach().float()
        self.tally.add(
            loss=losses.detach().sum(),
            correct=(chosen > rejected).sum(),
            chosen=chosen.sum(),
            rejected=rejected.sum(),
            pairs=len(chosen),
            reward_sq=(chosen**2).sum() + (rejected**2).sum(),
        )

    def _losses(self, samples: list[Preference]) -> torch.Tensor:
        """[b] per-pair losses (and their metrics recorded)."""
        chosen, rejected = self._scores(samples)
        margin = torch.tensor([s.margin for s in samples], device=chosen.device) if self.margin_loss else None
        losses = pairwise_rm_loss(chosen, rejected, kind=self.loss_kind, margin=margin)
        self._record(chosen, rejected, losses)
        return losses

    def micro_loss(self, samples: list[Preference], num_tokens: float, num_seqs: float) -> torch.Tensor:
        return self._losses(samples).sum() / num_seqs

    def score(self, samples: list[Preference]) -> None:
        self._losses(samples)

    def summary(self, sums: dict[str, float], *, evaluation: bool) -> dict[str, float]:
        pairs = max(sums["pairs"], 1.0)
        out = {
            "loss": sums["loss"] / pairs,
            "acc": sums["correct"] / pairs,
            "chosen_reward": sums["chosen"] / pairs,
            "reject_reward": sums["rejected"] / pairs,
            "margin": (sums["chosen"] - sums["rejected"]) / pairs,
        }
        if evaluation:  # OpenRLHF's: over chosen and rejected rewards together, unbiased std, at least 1e-8
            n = 2 * pairs
            mean = (sums["chosen"] + sums["rejected"]) / n
            std = max(math.sqrt(max(sums["reward_sq"] - n * mean**2, 0.0) / max(n - 1, 1.0)), 1e-8)
            self.reward_stats = (mean, std)
            out.update(reward_mean=mean, reward_std=std)
        return out

    def save(
        self,
        path: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        is_writer: bool,
        allow_nonfinite: bool = False,
        merged: bool = False,
    ) -> None:
        config = self.model.hf.config
        if self.reward_stats is not None:
            config.mean, config.std = self.reward_stats
        save_scalar_model(
            self.model,
            path,
            is_writer=is_writer,
            strategy=self.strategy,
            flag="--save_path",
            tokenizer=tokenizer,
            allow_nonfinite=allow_nonfinite,
            merged=merged,
        )


# ---- DPO ---------------------------------------------------------------------------------------------------------
# DPO (and IPO, cDPO): the policy's log-ratio to a frozen reference on chosen vs rejected responses.


@dataclass(frozen=True)
class DPOSettings:
    beta: float
    label_smoothing: float
    ipo: bool
    nll_loss_coef: float


@dataclass
class DPOTask:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    strategy: Strategy
    # frozen, wrapped by its own strategy; None with LoRA: the policy with its adapters disabled (its base)
    reference: nn.Module | None
    device: torch.device
    pad_id: int
    packing: bool
    settings: DPOSettings
    sp: SequenceParallel | None = None
    name: str = "dpo"
    tally_keys: tuple[str, ...] = ("loss", "correct", "chosen_reward", "rejected_reward", "pairs", "nll")
    tally: Tally = field(default_factory=Tally)

    def loss_tokens(self, sample: Preference) -> int:
        return 1  # both terms are means over pairs

    def _batch(self, samples: list[Preference]) -> RolloutBatch:
        return sequences_batch(
            [s.prompt for s in samples] * 2, [s.chosen for s in samples] + [s.rejected for s in samples], self.pad_id
        ).to(self.device)

    def _sequence_log_probs(self, model: nn.Module, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """[2b] summed response log-probs and [2b, r] per-token log-probs (chosen rows first)."""
        log_probs, _ = policy_log_probs(model, batch, 1.0, packing=self.packing, sp=self.sp)
        return sequence_log_prob(log_probs, batch.action_mask), log_probs

    def _terms(self, samples: list[Preference]) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-pair DPO losses [b], per-token mean NLL of each chosen response [b])."""
        b = len(samples)
        batch = self._batch(samples)
        # The reference first: with LoRA it is the policy's own (sharded) model, and this order keeps the policy's
        # forward the last one before its backward, as in a run with a separate reference.
        with torch.no_grad(), self._reference() as reference_model:
            reference, _ = self._sequence_log_probs(reference_model, batch)
        policy, token_log_probs = self._sequence_log_probs(self.model, batch)
        s = self.settings
        terms = dpo_loss(
            policy[:b],
            policy[b:],
            reference[:b],
            reference[b:],
            beta=s.beta,
            label_smoothing=s.label_smoothing,
            ipo=s.ipo,
        )
        nll = nll_term(token_log_probs[:b], batch.action_mask[:b])
        self.tally.add(
            loss=terms.losses.detach().sum(),
            correct=(terms.chosen_rewards > terms.rejected_rewards).sum(),
            chosen_reward=terms.chosen_rewards.sum(),
            rejected_reward=terms.rejected_rewards.sum(),
            pairs=b,
            nll=nll.detach().sum(),
        )
        return terms.losses, nll

    @contextmanager
    def _reference(self) -> Iterator[nn.Module]:
        """The reference model, in eval mode while open (no dropout: a frozen model's log-probs)."""
        if self.reference is not None:
            yield self.reference.eval()
            return
        training = self.model.training
        self.model.eval()
        try:
            with adapters_disabled(self.model):
                yield self.model
        finally:
            self.model.train(training)

    def micro_loss(self, samples: list[Preference], num_tokens: float, num_seqs: float) -> torch.Tensor:
        losses, nll = self._terms(samples)
        if self.settings.nll_loss_coef > 0:  # OpenRLHF's Llama-3.1 regulariser: a mean over pairs, like the DPO loss
            losses = losses + self.settings.nll_loss_coef * nll
        return losses.sum() / num_seqs

    def score(self, samples: list[Preference]) -> None:
        self._terms(samples)

    def summary(self, sums: dict[str, float], *, evaluation: bool) -> dict[str, float]:
        pairs = max(sums["pairs"], 1.0)
        chosen, rejected = sums["chosen_reward"] / pairs, sums["rejected_reward"] / pairs
        return {
            "loss": sums["loss"] / pairs,
            "acc": sums["correct"] / pairs,
            "chosen_reward": chosen,
            "reject_reward": rejected,
            "margin": chosen - rejected,
            "nll_loss": sums["nll"] / pairs,
        }

    def save(
        self,
        path: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        is_writer: bool,
        allow_nonfinite: bool = False,
        merged: bool = False,
    ) -> None:
        save_causal_lm(
            self.model,
            tokenizer,
            path,
            is_writer=is_writer,
            strategy=self.strategy,
            allow_nonfinite=allow_nonfinite,
            merged=merged,
        )
