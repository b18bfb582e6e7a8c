"""The trained model as Tinker's calls drive it, on every rank: forward / forward_backward over a data-parallel
share of the data with SUM semantics, and an AdamW step with the request's hyperparameters.

Gradients accumulate across forward_backward calls until optim_step, as Tinker's do. The data of a call are dealt
to the ranks in contiguous shares (uneven counts allowed); every rank runs the same number of micro-batches (FSDP2's
gathers are collective), a rank short of data a one-token forward scaled by zero. FSDP2 averages gradients over the
ranks, so each rank's loss is scaled by the world size: the reduced gradient is the sum over all data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from rlrun.algo.losses import log_probs_from_logits
from rlrun.launch.transfer import gather_json
from rlrun.models.loading import position_ids_from
from rlrun.models.lora import adapters_disabled
from rlrun.roles.forward import LOGITS_CHUNK, chunkable_head, vocab_log_probs
from rlrun.strategies.base import Strategy
from rlrun.strategies.parking import local
from rlrun.tinker.losses import LOSSES


@dataclass(frozen=True)
class Datum:
    """One Tinker datum as the ranks see it: the model input's tokens [N] and its per-token loss inputs ([N] each;
    `target_tokens` holds token ids)."""

    tokens: list[int]
    inputs: dict[str, list[float]]

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {
            key: torch.tensor(values, dtype=torch.long if key == "target_tokens" else torch.float32, device=device)
            for key, values in self.inputs.items()
        }


@dataclass(frozen=True)
class Adam:
    """Tinker's AdamParams for one optim_step."""

    learning_rate: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0  # 0: no clipping


@dataclass(frozen=True)
class Scored:
    """compute_logprobs's results on rank 0, per prompt: its tokens' log-probs after the first, and the token drawn
    after it with that token's log-prob."""

    prompt_log_probs: list[list[float]]
    drawn: list[tuple[int, float]]


@dataclass
class Passed:
    """A forward(_backward)'s results on rank 0, in the data's order: each datum's log-probs of its targets and its
    loss (the sum over its tokens)."""

    log_probs: list[list[float]] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    @property
    def loss_sum(self) -> float:
        return math.fsum(self.losses)


def share(count: int, world: int, rank: int) -> range:
    """Rank `rank`'s contiguous share of `count` data over `world` ranks (the first count % world ranks one more)."""
    base, extra = divmod(count, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


class TrainedPolicy:
    """The policy every rank trains (wrapped by its strategy), its optimizer, and this rank's place among the data-
    parallel ranks. Every method is collective over `group`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: Strategy,
        group: torch.distributed.ProcessGroup,
        device: torch.device,
        comm_device: torch.device,
        micro_batch: int,
        lora: bool,
    ) -> None:
        self.model, self.optimizer, self.strategy = model, optimizer, strategy
        self.group, self.device, self.comm_device = group, device, comm_device
        self.rank, self.world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        self.micro_batch = micro_batch
        self.steps = 0  # optimizer steps taken (a checkpoint's step)
        # LoRA: the adapters' first values (small), so that a new create_model can start from them again
        self._initial = [t.detach().clone() for t in self._trained()] if lora else []

    def forward(
        self, data: Sequence[Datum], loss_fn: str, config: Mapping[str, float], *, backward: bool
    ) -> Passed | None:
        """Each datum's log-probs and loss under `loss_fn`; with `backward`, their summed gradient added to the
        parameters' (until optim_step). The results on rank 0 (None elsewhere)."""
        mine = [data[i] for i in share(len(data), self.world, self.rank)]
        rounds = math.ceil(math.ceil(len(data) / self.world) / self.micro_batch)
        fn = LOSSES[loss_fn].fn
        self.model.train(backward)
        log_probs: list[list[float]] = []
        losses: list[float] = []
        for k in range(rounds):
            part = mine[k * self.micro_batch : (k + 1) * self.micro_batch]
            with torch.set_grad_enabled(backward):
                per_token = self._log_probs(part)
                terms = [fn(logp[: len(d.tokens)], d.tensors(self.device), config) for logp, d in zip(per_token, part)]
                total = torch.stack(terms).sum() if terms else per_token.sum() * 0.0
            if backward:
                (total * self.world).backward()
            log_probs += [logp[: len(d.tokens)].tolist() for logp, d in zip(per_token.detach(), part)]
            losses += [float(t.detach()) for t in terms]
        if not backward:  # a later load or reset writes the shards: the module must not keep gathered copies
            self.strategy.release_gathered(self.model)
        gathered = gather_json({"log_probs": log_probs, "losses": losses}, self.group, self.comm_device)
        if gathered is None:
            return None
        out = Passed()
        for piece in gathered:
            out.log_probs += piece["log_probs"]
            out.losses += piece["losses"]
        return out

    def _log_probs(self, part: Sequence[Datum]) -> torch.Tensor:
        """[b, n] fp32 log-probs of each datum's target tokens (right-padded to the longest, n); a rank without data
        this round feeds one token so that the collective forward still runs (its result unused)."""
        rows = [d.tokens for d in part] or [[0]]
        targets = [[int(t) for t in d.inputs["target_tokens"]] for d in part] or [[0]]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=self.device)
        target = torch.tensor([t + [0] * (width - len(t)) for t in targets], device=self.device)
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=self.device)
        kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from(mask), "use_cache": False}
        if chunkable_head(self.model):
            with vocab_log_probs(self.model, target, 1.0, LOGITS_CHUNK, with_entropy=False):
                return self.model(**kwargs).logits[..., 0].float()
        logits = self.model(**kwargs).logits.float()
        return log_probs_from_logits(logits, target)

    def score(self, prompts: Sequence[list[int]], keys: Sequence[int], temperature: float, base: bool) -> Scored | None:
        """compute_logprobs's request, on the trained model (`base`: with its LoRA adapters off, the base model):
        each prompt's log-probs of its tokens after the first, and one token drawn from the distribution after it
        (at `temperature`, by its key), with that token's log-prob. On rank 0 (None elsewhere). Collective."""
        mine = list(share(len(prompts), self.world, self.rank))
        rounds = math.ceil(math.ceil(len(prompts) / self.world) / self.micro_batch)
        self.model.train(False)
        out: list[list[float]] = []
        drawn: list[tuple[int, float]] = []
        with torch.no_grad(), adapters_disabled(self.model) if base else nullcontext():
            for k in range(rounds):
                part = [prompts[i] for i in mine[k * self.micro_batch : (k + 1) * self.micro_batch]]
                data = [Datum(p, {"target_tokens": [*p[1:], 0]}) for p in part]
                per_token = self._log_probs(data)
                out += [lp[: len(p) - 1].tolist() for lp, p in zip(per_token, part)]
                last = self._last_logits(part)  # [b, V]
                for row, i in zip(last, mine[k * self.micro_batch : (k + 1) * self.micro_batch]):
                    logp = torch.log_softmax(row.float() / temperature, -1)
                    generator = torch.Generator().manual_seed(int(keys[i]))
                    token = int(torch.multinomial(logp.exp().cpu(), 1, generator=generator))
                    drawn.append((token, float(logp[token])))
            # inside the adapters' context: PEFT turns requires_grad on again when it closes, on the parameters the
            # module holds, which must be the shards the optimizer steps rather than gathered copies
            self.strategy.release_gathered(self.model)
        gathered = gather_json({"prompt": out, "drawn": drawn}, self.group, self.comm_device)
        if gathered is None:
            return None
        return Scored([lp for g in gathered for lp in g["prompt"]], [tuple(d) for g in gathered for d in g["drawn"]])

    def _last_logits(self, rows: Sequence[list[int]]) -> torch.Tensor:
        """[b, V] logits after each row's last token (rows left-padded; one dummy row on a rank without any)."""
        rows = list(rows) or [[0]]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=self.device)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from(mask), use_cache=False, logits_to_keep=1
        )
        return out.logits[:, -1, :]

    def reset_adapters(self) -> None:
        """A fresh LoRA model (create_model again on a LoRA job): the adapters as they started, Adam's state cleared,
        the step count at 0. Nothing is gathered: each rank restores its own shards of the adapters."""
        with torch.no_grad():
            for param, initial in zip(self._trained(), self._initial):
                param.copy_(initial)
        self.optimizer.state.clear()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps = 0

    def _trained(self) -> list[torch.Tensor]:
        """This rank's local tensors of the trained parameters (FSDP2 DTensors' shards): the optimizer's, not the
        module's (after a no-grad forward FSDP2 may leave gathered copies registered there)."""
        return [local(p) for group in self.optimizer.param_groups for p in group["params"]]

    def optim_step(self, adam: Adam) -> dict[str, float]:
        """One AdamW step over the accumulated gradients with `adam`'s settings, then the gradients cleared. A non-
        finite gradient norm leaves the weights as they were (said in the metrics)."""
        for group in self.optimizer.param_groups:
            group["lr"] = adam.learning_rate
            group["betas"] = (adam.beta1, adam.beta2)
            group["eps"] = adam.eps
            group["weight_decay"] = adam.weight_decay
        norm = self.strategy.clip_grad_norm(self.model, adam.grad_clip_norm)
        finite = math.isfinite(norm)
        if finite:
            self.optimizer.step()
            self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": norm if finite else float("nan"), "skipped:sum": float(not finite)}

    def state_dict(self) -> dict[str, int]:
        return {"step": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = int(state["step"])
