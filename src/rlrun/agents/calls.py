"""Agent calls: one persistent asyncio loop (in a thread) runs every reset()/step() of a rank's agents,
bounded in number and time; results are checked here, so a broken agent is one clear AgentError.

The loop outlives a batch because agents may keep loop-bound objects (HTTP sessions, a shared
retriever client) between turns. A call that blocks the loop (sync sleep inside `async def`) is
caught too: every batch of calls has a hard deadline on the calling thread."""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Protocol

from rlrun.runtime.errors import AgentError
from rlrun.runtime.pyfile import one_line


class Instance(Protocol):
    async def reset(self, states: dict, **kwargs: Any) -> dict: ...

    async def step(self, states: dict, **kwargs: Any) -> dict: ...


@dataclass(frozen=True)
class StepResult:
    reward: float
    feedback: str
    done: bool
    extra_logs: dict[str, float]


def _short(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _number(value: object, what: str) -> float:
    """A finite float from a number or a one-element tensor/array (OpenRLHF agents return torch.tensor(r))."""
    item = getattr(value, "item", None)
    if item is not None and getattr(value, "numel", lambda: 1)() == 1:
        value = item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AgentError(f"{what} must be a number or a one-element tensor, got {_short(value)}")
    if not math.isfinite(value):
        raise AgentError(f"{what} must be finite, got {value}")
    return float(value)


def check_step(raw: object, where: str, passed_sampling: object) -> StepResult:
    """OpenRLHF's step() result -> StepResult, or AgentError naming what is wrong."""
    if not isinstance(raw, dict):
        raise AgentError(
            f"{where} returned {_short(raw)}; it must return a dict with 'rewards', 'environment_feedback' and 'done'"
        )
    missing = [k for k in ("rewards", "environment_feedback", "done") if k not in raw]
    if missing:
        raise AgentError(f"{where} returned a dict without {', '.join(map(repr, missing))} (keys: {sorted(raw)})")
    feedback = raw["environment_feedback"]
    if not isinstance(feedback, str):
        raise AgentError(f"{where}: 'environment_feedback' must be text, got {_short(feedback)}")
    done = raw["done"]
    done = done.item() if hasattr(done, "item") else done
    if not isinstance(done, (bool, int)):
        raise AgentError(f"{where}: 'done' must be a bool, got {_short(done)}")
    sampling = raw.get("sampling_params")
    if sampling is not None and sampling is not passed_sampling:
        raise AgentError(
            f"{where} returned new 'sampling_params'; rlrun samples every turn with the run's "
            "settings (--temperature, --top_p, --max_tokens_per_turn): return states['sampling_params'] "
            "or None"
        )
    extra = raw.get("extra_logs") or {}
    if not isinstance(extra, dict):
        raise AgentError(f"{where}: 'extra_logs' must be a dict of numbers, got {_short(extra)}")
    logs = {str(k): _number(v, f"{where}: extra_logs[{k!r}]") for k, v in extra.items()}
    return StepResult(_number(raw["rewards"], f"{where}: 'rewards'"), feedback, bool(done), logs)


def _make(factory: Callable[[], Instance]) -> Instance | Awaitable[Instance]:
    """factory(); OpenRLHF's own example declares `async def __init__`, which plain construction rejects,
    so such a class is built in two steps with its __init__ awaited."""
    cls: type[Instance] | None = factory if isinstance(factory, type) else None
    if cls is not None and inspect.iscoroutinefunction(cls.__init__):
        instance = cls.__new__(cls)

        async def init() -> Instance:
            await cls.__init__(instance)  # type: ignore[misc]
            return instance

        return init()
    return factory()


class AgentCalls:
    def __init__(self, *, timeout_s: float, max_concurrency: int, source: str) -> None:
        self.timeout_s, self.source = timeout_s, source
        self.max_concurrency = max_concurrency
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlrun-agents", daemon=True)
        self._thread.start()
        self._semaphore: asyncio.Semaphore | None = None

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)

    # ---- the three batched operations ----------------------------------------------------------

    def construct(self, factory: Callable[[], Instance], count: int) -> list[Instance]:
        async def one(i: int) -> Instance:
            made = _make(factory)
            return await made if inspect.isawaitable(made) else made

        return self._batch("__init__()", [one(i) for i in range(count)], list(range(count)))

    def reset(self, agents: Sequence[Instance], prompts: list[str], labels: list[str | None]) -> list[str]:
        raw = self._batch(
            "reset()",
            [a.reset({"observation": p, "label": lb}) for a, p, lb in zip(agents, prompts, labels)],
            list(range(len(agents))),
        )
        out = []
        for i, r in enumerate(raw):
            obs = r.get("observation") if isinstance(r, dict) else None
            if not isinstance(obs, str):
                raise AgentError(
                    f"agent {self.source} reset() of episode {i} returned {_short(r)}; it must return "
                    "a dict whose 'observation' is the text to continue from (usually "
                    "states['observation'])"
                )
            out.append(obs)
        return out

    def step(
        self,
        agents: Sequence[Instance],
        rows: list[int],
        texts: list[str],
        actions: list[str],
        labels: list[str | None],
        turn: int,
        last: list[bool],
    ) -> list[StepResult]:
        sampling = {"turn": turn}  # the object step() may hand back as its 'sampling_params'
        coros = [
            agents[i].step(
                {
                    "observation_text": text,
                    "action_text": action,
                    "label": label,
                    "sampling_params": sampling,
                    "turn": turn,
                    "last_turn": is_last,
                }
            )
            for i, text, action, label, is_last in zip(rows, texts, actions, labels, last)
        ]
        raw = self._batch(f"step() of turn {turn}", coros, rows)
        return [
            check_step(r, f"agent {self.source} step() of episode {i}, turn {turn},", sampling)
            for i, r in zip(rows, raw)
        ]

    # ---- running coroutines on the loop ------------------------------------------------------

    def _batch(self, what: str, coros: Sequence[Awaitable[Any]], rows: list[int]) -> list[Any]:
        async def bounded(coro: Awaitable[Any], row: int) -> Any:
            if self._semaphore is None:
                self._semaphore = asyncio.Semaphore(self.max_concurrency)
            async with self._semaphore:
                try:
                    return await asyncio.wait_for(coro, self.timeout_s)
                except asyncio.TimeoutError:
                    raise AgentError(
                        f"agent {self.source} {what} of episode {row} took longer than "
                        f"--agent_timeout {self.timeout_s:g}s"
                    ) from None
                except AgentError:
                    raise
                except Exception as exc:
                    raise AgentError(
                        f"agent {self.source} {what} of episode {row} raised {one_line(exc)}"[:600]
                    ) from exc

        async def all_of() -> list[Any]:
            return list(await asyncio.gather(*(bounded(c, r) for c, r in zip(coros, rows))))

        future = asyncio.run_coroutine_threadsafe(all_of(), self._loop)
        # Calls wait for a slot, so the deadline grows with the number of waves; the margin covers a
        # call that blocks the loop itself, which wait_for cannot interrupt.
        waves = max(1, -(-len(coros) // self.max_concurrency))
        try:
            return future.result(timeout=self.timeout_s * waves + 5.0)
        except FutureTimeout:
            future.cancel()
            raise AgentError(
                f"agent {self.source} {what} did not return within {self.timeout_s * waves + 5.0:g}s: "
                "an agent blocks the event loop (a synchronous call inside async code?)"
            ) from None
