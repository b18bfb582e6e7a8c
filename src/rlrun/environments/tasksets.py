"""verifiers 0.4 environments as the episode source (--env_id): each row's task runs as a verifiers episode
(`env.run_episode`) whose model calls reach this rank's engine through the token gateway, with verifiers' training
client (`TrainClientConfig`: it renders the chat to ids itself and calls vLLM's token route, /inference/v1/generate).

The row is the trace's first branch as verifiers recorded it: the ids before the first sampled token are the prompt;
the rest is the response, `sampled_mask` its action mask and the branch's log-probs (the gateway's, the engine's)
its engine log-probs; the reward is `trace.reward`, the weighted sum of the rubric, and each rubric score and metric
is logged (agent/reward/<name>, agent/metric/<name>). A trace with more branches (a turn that does not extend the
previous ids) trains its first; the others are counted in agent/calls_off_branch. A failed episode (an error in the
trace, a harness failure, over --agent_timeout) trains nothing (rlrun.environments.rows).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlrun.agents.episodes import Episodes
from rlrun.config.agent import AgentConfig
from rlrun.config.generation import GenerationConfig
from rlrun.data.prompts import Prompts
from rlrun.data.tasksets import load_environment, tasks_of, verifiers_v1
from rlrun.engines.protocol import Engine
from rlrun.environments.rows import (
    EpisodeLimits,
    Outcome,
    Row,
    episode_limits,
    episode_loop,
    extend,
    finish,
    gateway_opener,
)
from rlrun.gateway.server import Gateway, Session

KEY_VARIABLE = "RLRUN_GATEWAY_KEY"  # verifiers' client reads its API key from a variable it is told the name of


def trace_row(trace: Any, budget: int) -> tuple[Row, Outcome]:
    """A verifiers trace's first branch as a row, and its reward (or why it failed)."""
    if not trace.branches:
        return Row(prompt=[]), Outcome(error="its trace has no model call")
    branch = trace.branches[0]
    mask = [int(bool(m)) for m in branch.sampled_mask]
    if 1 not in mask:
        return Row(prompt=list(branch.token_ids)), Outcome(error="its first branch has no sampled token")
    start = mask.index(1)
    row = Row(prompt=list(branch.token_ids[:start]), off_branch=len(trace.branches) - 1)
    row.calls = sum(1 for k in range(start, len(mask)) if mask[k] and (k == start or not mask[k - 1]))
    tokens, log_probs = list(branch.token_ids[start:]), [float(x) for x in branch.logprobs[start:]]
    for t, m, lp in zip(tokens, mask[start:], log_probs):
        extend(row, [t], m, [lp if m else 0.0], budget)
        if row.truncated:
            break
    errors = list(trace.errors or [])
    if errors:
        first = errors[0]
        return row, Outcome(error=f"{getattr(first, 'type', 'error')}: {' '.join(str(first.message).split())[:300]}")
    metrics = {f"reward/{name}": float(r.score) for name, r in trace.rewards.items() if r is not None}
    metrics.update({f"metric/{name}": float(v) for name, v in trace.metrics.items() if isinstance(v, (int, float))})
    return row, Outcome(reward=float(trace.reward), metrics=metrics)


@dataclass(frozen=True)
class ModelCalls:
    """How an episode's model calls are made: verifiers' training client for a gateway session, the sampling
    settings verifiers sends, the served model's name."""

    client: Callable[[Session], Any]
    sampling: Any
    model: str


class TasksetEpisodes:
    """One engine rank's verifiers episodes: an event loop of their own (in a thread, with verifiers' interception
    server kept up between steps) runs them while the rank's thread serves their calls through the gateway."""

    def __init__(
        self,
        env: Any,
        tasks: tuple,
        calls: ModelCalls,
        open_gateway: Callable[[], Gateway],
        limits: EpisodeLimits,
        pad_id: int,
    ) -> None:
        self.env, self.tasks, self.calls, self.limits, self.pad_id = env, tasks, calls, limits, pad_id
        self._open_gateway = open_gateway
        self.gateway: Gateway | None = None
        self.phases = 0
        self._loop = episode_loop()
        self._serving: Any = None

    def _start(self) -> Gateway:
        gateway = self._open_gateway()
        os.environ[KEY_VARIABLE] = gateway.token

        async def enter() -> Any:
            serving = self.env.serving()  # verifiers' interception server, up for the whole run
            await serving.__aenter__()
            return serving

        self._serving = asyncio.run_coroutine_threadsafe(enter(), self._loop).result(timeout=120)
        atexit.register(self.close)
        return gateway

    def close(self) -> None:
        """Take verifiers' interception server down and stop the loop (bounded: at the run's end)."""
        if self._serving is not None:
            serving, self._serving = self._serving, None
            try:
                asyncio.run_coroutine_threadsafe(serving.__aexit__(None, None, None), self._loop).result(timeout=10)
            except Exception:  # noqa: BLE001 - a server that does not stop cleanly is left to the process's end
                pass
        if self.gateway is not None:
            self.gateway.close()
            self.gateway = None

    def episodes(
        self, engine: Engine, prompts: Prompts, rows: list[int], prompt_ids: list[list[int]], seed: int
    ) -> Episodes:
        if self.gateway is None:
            self.gateway = self._start()
        gateway = self.gateway
        sessions = [gateway.open_session() for _ in rows]
        runs: list[Future] = []
        for i, session in zip(rows, sessions):
            extra = prompts.records[i].extra_info or {}
            runs.append(
                asyncio.run_coroutine_threadsafe(self._one(self.tasks[int(extra["task"])], session), self._loop)
            )
        gateway.serve(engine, seed, self.phases, until=lambda: all(r.done() for r in runs))
        built, outcomes = [], []
        for ids, run, session in zip(prompt_ids, runs, sessions):
            row, outcome = run.result()
            built.append(row if row.prompt else Row(prompt=list(ids)))
            outcomes.append(outcome)
            gateway.close_session(session)
        self.phases += 1
        groups = [prompts.texts[i] for i in rows]
        lim = self.limits
        return finish(built, outcomes, groups, lim.prompt_max_len, self.pad_id, "verifiers episodes (--env_id)")

    async def _one(self, task: Any, session: Session) -> tuple[Row, Outcome]:
        from verifiers.v1.clients import ModelContext  # noqa: PLC0415 - the optional extra's

        calls, timeout = self.calls, self.limits.timeout_s
        ctx = ModelContext(model=calls.model, client=calls.client(session), sampling=calls.sampling)
        try:
            episode = await asyncio.wait_for(self.env.run_episode(task, ctx), timeout)
        except asyncio.TimeoutError:
            return Row(prompt=[]), Outcome(error=f"took longer than --agent_timeout {timeout:g}s")
        except Exception as exc:  # noqa: BLE001 - an environment's failure ends its episode, counted
            return Row(prompt=[]), Outcome(error=f"raised {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        if not episode.traces:
            first = episode.errors[0] if episode.errors else "no trace"
            return Row(prompt=[]), Outcome(error=f"ended without a trace ({first})")
        trainable = [t for t in episode.traces if t.agent is None or t.agent.trainable]
        if not trainable:
            return Row(prompt=[]), Outcome(error="no trainable seat made a trace (a user simulation's only)")
        return trace_row(trainable[0], self.limits.response_budget)


def renderer_config(tokenizer: PreTrainedTokenizerBase, source: str) -> Any:
    """How verifiers renders the policy's chats: the model's own renderer when renderers knows the model by its hub
    id (`source`, --pretrain as given: Qwen3, GLM, Llama 3, ...), else the chat template (renderers' default) with
    Hermes JSON tool calls read from replies (`<tool_call>{...}</tool_call>`, renderers' "qwen3" parser) when the
    tokenizer has that token, as Qwen2.5 and other Hermes-style chat models do (without it, a taskset that offers
    tools fails its episodes with renderers' own message)."""
    from renderers import AutoRendererConfig, DefaultRendererConfig  # noqa: PLC0415 - verifiers' dependency
    from renderers.base import MODEL_RENDERER_MAP  # noqa: PLC0415

    if source in MODEL_RENDERER_MAP:
        return AutoRendererConfig()
    vocab = tokenizer.get_vocab()
    return DefaultRendererConfig(tool_parser="qwen3" if "<tool_call>" in vocab and "</tool_call>" in vocab else None)


def build_taskset_episodes(
    a: AgentConfig,
    g: GenerationConfig,
    tokenizer: PreTrainedTokenizerBase,
    model: str,
    tokenizer_source: str | None,
    slot: int,
    count: int,
) -> TasksetEpisodes:
    """--env_id's episodes on engine rank number `slot`: the taskset's first `count` tasks (the prompt records'),
    verifiers' training client on the gateway's session URL, rendering with `tokenizer_source` (the policy's folder
    or hub id; the embedded demo's tokenizer is saved to a temporary folder)."""
    assert a.env_id is not None
    verifiers_v1()
    import verifiers.v1 as vf  # noqa: PLC0415
    from verifiers.v1.configs.client import TrainClientConfig  # noqa: PLC0415

    env = load_environment(a.env_id, a.env_args, a.env_harness, a.max_turns)
    tasks = tasks_of(a.env_id, a.env_args, a.env_harness, a.max_turns, count)
    if tokenizer_source is None:
        tokenizer_source = tempfile.mkdtemp(prefix="rlrun_tokenizer_")
        tokenizer.save_pretrained(tokenizer_source)
    cap = a.max_tokens_per_turn or g.generate_max_len
    renderer = renderer_config(tokenizer, tokenizer_source)

    def client(session: Session) -> Any:
        return TrainClientConfig(
            base_url=session.base_url,
            api_key_var=KEY_VARIABLE,
            renderer=renderer,
            renderer_model_name=tokenizer_source,
        )

    sampling = vf.SamplingConfig(temperature=g.temperature, top_p=g.top_p, max_tokens=cap)
    limits = episode_limits(a, g)
    opener = gateway_opener(a, g, tokenizer, model, slot, max_calls=False)
    return TasksetEpisodes(env, tasks, ModelCalls(client, sampling, model), opener, limits, int(tokenizer.pad_token_id))
