"""TRL environment classes as the episode source (--environment_factory module:Class, or path/to/file.py:Class): a
TRL user's environment file runs unchanged, with TRL's contract (trl.GRPOTrainer's `environment_factory`, TRL 1.x).

The factory (a class, or any callable returning an instance) is called once per concurrent episode and its
instances are reused from step to step ("construct once, reset often"). An episode:
  * `reset(**row)` with the record's columns as the dataset holds them (its prompt under its own column name); a
    string it returns is appended to the prompt's last message, as TRL appends it (no separator);
  * the first model turn reads that conversation through the chat template with `tools=` the instance's public
    methods (all but reset and get_reward; transformers turns each into a JSON schema from its signature and
    docstring, as TRL passes them);
  * a reply with Hermes tool calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the format of Qwen2.5/3
    and the other templates vLLM's hermes parser reads) runs each call on the instance; the result (`str(result)`,
    or `{'error': ...}` when the call raised or names no tool, as TRL reports it to the model) becomes a tool
    message, and the chat template's rendering of those messages is appended as ids after the reply (observation
    tokens, mask 0; the ids TRL's `_get_tool_suffix_ids` computes); the model then answers again;
  * the episode ends at a reply without tool calls, at --max_turns model calls (TRL's max_tool_calling_iterations N
    is --max_turns N+1) or when --generate_max_len is used up.
The reward is `get_reward()` when the class defines it (weight 1, as TRL adds it) plus the run's reward function
(--remote_rm_url or --compute_score, when set) over the record's prompt and the decoded response: the replies and
the tool results between them. A reset that raises or outlives --agent_timeout fails the episode (it trains
nothing, counted); a tool that raises is the model's to read, counted in agent/tool_failures.

The model samples through the gateway (in process: the rank's own engine, batched across episodes), so the row is
the session's ids (rlrun.environments.rows).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlrun.agents.episodes import Episodes
from rlrun.config.agent import AgentConfig
from rlrun.config.generation import GenerationConfig
from rlrun.data.prompts import Prompts
from rlrun.data.sources import Messages, render
from rlrun.engines.protocol import Engine
from rlrun.environments.rows import (
    EpisodeFailed,
    EpisodeLimits,
    InProcessSessions,
    Outcome,
    add_transcript_rewards,
    episode_limits,
    finish,
    gateway_opener,
    in_thread,
)
from rlrun.gateway.server import Gateway, Session
from rlrun.gateway.wire import Call, tool_calls
from rlrun.rewards.reward_fn import RewardFunction
from rlrun.runtime.errors import ConfigError
from rlrun.runtime.pyfile import import_file, one_line

NOT_TOOLS = ("reset", "get_reward")


# ---- the class ---------------------------------------------------------------------------------------------------


def load_factory(spec: str) -> Callable[[], Any]:
    """`module:Name` or `path/to/file.py:Name`: the factory it names, or one ConfigError saying what is wrong."""
    where, _, name = spec.rpartition(":")
    if not where or not name.isidentifier():
        raise ConfigError(
            f"--environment_factory {spec!r} names no class; write module:Class or path/to/file.py:Class "
            "(e.g. my_env.py:GuessEnv)"
        )
    if where.endswith(".py"):
        module = import_file(where, "environment file", ConfigError, f"class {name}")
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ConfigError(
                f"--environment_factory {spec}: module {where} does not import ({one_line(exc)}); put its folder on "
                "PYTHONPATH or pass the file: path/to/file.py:Class"
            ) from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ConfigError(f"--environment_factory {spec}: {where} defines no class or function {name}")
    return factory


def tools_of(instance: Any) -> list[Callable[..., Any]]:
    """The instance's tools: the public functions of its class but reset and get_reward, bound, in name order (what
    TRL offers the model; read on the class so that properties are not evaluated)."""
    members = inspect.getmembers(type(instance), predicate=inspect.isfunction)
    return [getattr(instance, n) for n, _ in members if n not in NOT_TOOLS and not n.startswith("_")]


@dataclass(frozen=True)
class EnvironmentClass:
    """What the probe showed: the factory and whether its class owns a reward; the probe instance itself, the first of
    the episodes' pool (as TRL keeps it: a constructor may be costly)."""

    spec: str
    factory: Callable[[], Any]
    owns_reward: bool
    first: Any


def probe(spec: str) -> EnvironmentClass:
    """Load the factory and check one instance as TRL does at start-up (a callable reset), and that every tool has
    the schema the chat template needs (type hints and a docstring with an Args section)."""
    from transformers.utils import get_json_schema  # noqa: PLC0415 - the schema transformers renders for tools=

    factory = load_factory(spec)
    try:
        instance = factory()
    except Exception as exc:  # noqa: BLE001 - the user's constructor: one line
        raise ConfigError(f"--environment_factory {spec}: making an instance raised {one_line(exc)}") from None
    if not callable(getattr(instance, "reset", None)):
        raise ConfigError(f"--environment_factory {spec}: {type(instance).__name__} defines no reset(**row) method")
    for tool in tools_of(instance):
        try:
            get_json_schema(tool)
        except Exception as exc:  # noqa: BLE001 - transformers' DocstringParsingException, TypeError, ...
            raise ConfigError(
                f"--environment_factory {spec}: tool {tool.__name__} has no schema the chat template can show "
                f"({one_line(exc)}); give it type hints and a docstring with an Args: section, as TRL requires"
            ) from None
    owns = callable(getattr(type(instance), "get_reward", None))
    return EnvironmentClass(spec, factory, owns, instance)


# ---- turns as ids ------------------------------------------------------------------------------------------------


def first_messages(prompt: str | Messages, observation: Any) -> list[dict]:
    """The record's prompt as a conversation, with reset's string appended to its last message's text (TRL's
    `content + observation`)."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if isinstance(observation, str) and observation:
        messages[-1]["content"] = f"{messages[-1]['content']}{observation}"
    return messages


def tool_suffix(tokenizer: PreTrainedTokenizerBase, messages: list[dict], ended: bool, kwargs: dict) -> str:
    """The template's text for tool messages that follow a reply, up to the next generation prompt: what follows the
    end marker (EOS) of a rendered tool-call turn (the ids TRL's `_get_tool_suffix_ids` takes from the same two
    dummy conversations), with the end marker itself when the reply was cut before it. The turn is found by counting
    end markers, so a template that renders a past turn differently (Qwen3 drops its empty think block; TRL swaps in
    a training template for that) gives the same text; one without an EOS per turn must render the past verbatim."""
    call = {"type": "function", "function": {"name": messages[0]["name"], "arguments": {}}}
    turn: dict = {"role": "assistant", "content": "", "tool_calls": [call]}
    dummy = [{"role": "user", "content": "dummy"}, turn]
    prefix = render(tokenizer, dummy, False, "a tool call turn", kwargs)
    full = render(tokenizer, dummy + messages, True, "the tool results", kwargs)
    eos = str(tokenizer.eos_token or "")
    ends = prefix.count(eos) if eos else 0
    if ends == 0:
        if not full.startswith(prefix):
            raise EpisodeFailed("the chat template renders the turn before tool messages differently once they follow")
        return full[len(prefix) :]
    cut = -len(eos)
    for _ in range(ends):
        cut = full.find(eos, cut + len(eos))
        if cut < 0:
            raise EpisodeFailed("the chat template ends fewer turns once tool messages follow them")
    return full[cut + len(eos) if ended else cut :]


async def call_tool(tool: Callable[..., Any] | None, name: str, arguments: str) -> tuple[str, bool]:
    """One call of a tool (a coroutine function awaited, any other on a thread of its own) and its message text:
    `str(result)`, or TRL's `{'error': ...}` (and False) when it raised, its arguments were not an object, or no tool
    has its name."""
    try:
        if tool is None:
            raise ValueError(f"Tool {name} not found.")
        args = json.loads(arguments)
        if not isinstance(args, dict):
            raise TypeError(f"arguments {arguments[:80]} are not an object")
        result = await tool(**args) if inspect.iscoroutinefunction(tool) else await in_thread(tool, **args)
        return str(result), True
    except Exception as exc:  # noqa: BLE001 - shown to the model, as TRL shows it
        return str({"error": str(exc)}), False


# ---- the episodes ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolTurns:
    """How an episode's model turns are asked and bounded."""

    max_turns: int | None
    max_tokens: int  # per call
    template_kwargs: dict  # the data section's apply_chat_template_kwargs


class FactoryEpisodes:
    """One engine rank's episodes of a TRL environment class: each on the process's event loop for environments,
    with an instance of its own from the pool, its model calls queued on the gateway this rank's thread serves."""

    def __init__(
        self,
        env: EnvironmentClass,
        turns: ToolTurns,
        limits: EpisodeLimits,
        tokenizer: PreTrainedTokenizerBase,
        reward_fn: RewardFunction | None,
        open_gateway: Callable[[], Gateway],
    ) -> None:
        self.env, self.turns, self.limits, self.tokenizer, self.reward_fn = env, turns, limits, tokenizer, reward_fn
        self.sessions = InProcessSessions(open_gateway, limits)
        self.pool: list[Any] = [env.first]  # instances, made as a batch first needs them, reused after

    def episodes(
        self, engine: Engine, prompts: Prompts, rows: list[int], prompt_ids: list[list[int]], seed: int
    ) -> Episodes:
        while len(self.pool) < len(rows):
            self.pool.append(self.env.factory())

        def episode(gateway: Gateway, session: Session, i: int, k: int) -> Coroutine[Any, Any, Outcome]:
            return self._one(gateway, session, self.pool[k], prompts, i)

        built, outcomes = self.sessions.run(engine, seed, rows, prompt_ids, episode)
        if self.reward_fn is not None:  # TRL's reward_funcs, added to get_reward's
            add_transcript_rewards(self.reward_fn, prompts, rows, built, outcomes, self.tokenizer)
        groups = [prompts.texts[i] for i in rows]
        what = f"episodes of --environment_factory {self.env.spec}"
        return finish(built, outcomes, groups, self.limits.prompt_max_len, int(self.tokenizer.pad_token_id), what)

    async def _one(self, gateway: Gateway, session: Session, instance: Any, prompts: Prompts, i: int) -> Outcome:
        record, t = prompts.records[i], self.turns
        row = dict(record.columns) if record.columns is not None else {"prompt": record.prompt, "label": record.label}
        try:
            observation = await in_thread(instance.reset, **row)
            observation = await observation if inspect.isawaitable(observation) else observation
        except Exception as exc:  # noqa: BLE001 - the user's reset: the episode fails, counted
            raise EpisodeFailed(f"reset raised {one_line(exc)[:300]}") from None
        tools = {tool.__name__: tool for tool in tools_of(instance)}
        kwargs = {**t.template_kwargs, "tools": list(tools.values()) or None}
        text = render(self.tokenizer, first_messages(record.prompt, observation), True, "the episode's prompt", kwargs)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        calls = failures = turn = 0
        while True:
            call = Call(prompt=ids, max_tokens=min(t.max_tokens, self.limits.response_budget), logprobs=True)
            reply = await asyncio.get_running_loop().run_in_executor(None, gateway.submit, call, session)
            turn += 1
            _, requested = tool_calls(str(self.tokenizer.decode(reply.tokens, skip_special_tokens=True)))
            used = len(ids) + len(reply.tokens) - len(session.calls[0].call.prompt)
            if not requested or turn == t.max_turns or used >= self.limits.response_budget:
                break
            messages = []
            for requested_call in requested:
                function = requested_call["function"]
                tool = tools.get(function["name"])
                content, ok = await call_tool(tool, function["name"], function["arguments"])
                calls, failures = calls + 1, failures + (not ok)
                messages.append({"role": "tool", "name": function["name"], "content": content})
            suffix = tool_suffix(self.tokenizer, messages, gateway.at_end(reply), t.template_kwargs)
            ids = ids + reply.tokens + self.tokenizer.encode(suffix, add_special_tokens=False)
        reward = await _reward(instance) if self.env.owns_reward else None  # else the reward function's alone
        return Outcome(reward=reward, metrics={"tool_calls": float(calls), "tool_failures": float(failures)})


async def _reward(instance: Any) -> float:
    """get_reward(), async or on a thread of its own, as a finite float; EpisodeFailed otherwise."""
    try:
        if inspect.iscoroutinefunction(instance.get_reward):
            value = await instance.get_reward()
        else:
            value = await in_thread(instance.get_reward)
        reward = float(value)
    except Exception as exc:  # noqa: BLE001 - the user's get_reward: the episode fails, counted
        raise EpisodeFailed(f"get_reward raised {one_line(exc)[:300]}") from None
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise EpisodeFailed(f"get_reward returned {value!r}, not a finite number")
    return reward


def build_factory_episodes(
    a: AgentConfig,
    g: GenerationConfig,
    template_kwargs: dict,
    tokenizer: PreTrainedTokenizerBase,
    reward_fn: RewardFunction | None,
    model: str,
    slot: int,
) -> FactoryEpisodes:
    """--environment_factory's episodes on engine rank number `slot` (its gateway serves them in process;
    --gateway_port opens it to outside callers too). `reward_fn`: the run's reward function when one is set."""
    assert a.environment_factory is not None
    env = probe(a.environment_factory)
    if not env.owns_reward and reward_fn is None:
        raise ConfigError(
            f"--environment_factory {a.environment_factory} defines no get_reward() and no reward function is set: "
            "define get_reward(self) -> float on the class, or pass --remote_rm_url FILE.py (TRL's reward_funcs)"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"--environment_factory {a.environment_factory}: the policy's tokenizer has no chat template, which "
            "shows the tools and renders their results; use a chat model (a chat_template in its tokenizer_config.json)"
        )
    turns = ToolTurns(a.max_turns, a.max_tokens_per_turn or g.generate_max_len, dict(template_kwargs))
    opener = gateway_opener(a, g, tokenizer, model, slot, max_calls=False)
    return FactoryEpisodes(env, turns, episode_limits(a, g), tokenizer, reward_fn, opener)
