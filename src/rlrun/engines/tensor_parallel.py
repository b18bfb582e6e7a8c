"""One vLLM engine over an engine's T ranks (--vllm_tensor_parallel_size T > 1).

The engine's first rank hosts the vLLM child with T tensor-parallel workers and alone takes the actor's weights
(its sink writes the file the workers read; the other ranks keep nothing, and only join the actor's gathers when
they are actor ranks too); every rank still produces its own share of the rollouts. On each sample() call the ranks
hand their prompts and seeds to the first rank, which samples all rows in one call, with every row keeping the seed
its own rank gave it, and hands each rank its rows back. Every rank of
the engine must therefore call sample() the same number of times (single-turn generation and evaluation do;
multi-turn episodes are refused with tensor parallel > 1 before anything starts).
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import nn

from rlrun.engines.base import Generation, SamplingSettings
from rlrun.engines.vllm_engine import VLLMEngine, request_seeds


class RowExchange(Protocol):
    """Provided by rlrun.launch.transfer.EngineRowExchange (the engine's process group stays there)."""

    is_leader: bool

    def to_leader(self, mine: object) -> list[object] | None: ...

    def from_leader(self, parts: list[object] | None) -> object: ...


class TensorParallelEngine:
    def __init__(self, model: nn.Module, sampling: SamplingSettings, exchange: RowExchange,
                 leader: VLLMEngine | None) -> None:
        assert (leader is not None) == exchange.is_leader
        self.model = model  # on the meta device: the parameters' names and shapes
        self.sink = leader.sink if leader is not None else None
        self.loader = None
        self.sampling = sampling
        self.exchange = exchange
        self.leader = leader

    def sample(self, prompts: list[list[int]], seed: int, *, max_new_tokens: int | None = None,
               stop: tuple[str, ...] = ()) -> Generation:
        parts = self.exchange.to_leader({"prompts": prompts, "seed": seed})
        answers: list[object] | None = None
        if self.leader is not None:
            assert parts is not None
            shares: list[dict[str, Any]] = parts  # type: ignore[assignment]
            rows = [p for share in shares for p in share["prompts"]]
            seeds = [s for share in shares for s in request_seeds(share["seed"], len(share["prompts"]))]
            # The sampling settings may have been changed on this object (evaluation's temperature): use them.
            self.leader.sampling = self.sampling
            out = self.leader.sample_seeded(rows, seeds, max_new_tokens=max_new_tokens, stop=stop)
            answers, start = [], 0
            for share in shares:
                end = start + len(share["prompts"])
                answers.append({"responses": out.responses[start:end], "log_probs": out.log_probs[start:end]
                                if out.log_probs is not None else None})
                start = end
        mine: dict[str, Any] = self.exchange.from_leader(answers)  # type: ignore[assignment]
        return Generation(mine["responses"], mine["log_probs"])

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        return self.sample(prompts, seed).responses

    def load_weights(self) -> None:
        if self.leader is not None:
            self.leader.load_weights()

    def sleep(self) -> None:
        if self.leader is not None:
            self.leader.sleep()

    def wake(self) -> None:
        if self.leader is not None:
            self.leader.wake()

    def close(self) -> None:
        if self.leader is not None:
            self.leader.close()
