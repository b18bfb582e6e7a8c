"""OpenEnv servers as the episode source (--openenv_url, or --openenv_app: a server each engine rank starts, below):
each episode is one WebSocket session of the server (its
`/ws` route, what OpenEnv's own EnvClient uses; HTTP /reset and /step make a new environment per call), spoken by
rlrun itself: openenv is never imported here (it cannot share a venv with verifiers 0.4).

An episode: `reset` with the record's fields as keyword arguments (its `label`, when it has one, and its
`extra_info`; the server keeps those its reset takes) and an episode id; the first model turn reads the record's
prompt with the reset observation's text appended to its last user message, through the chat template (longer than
--prompt_max_len: its last tokens, counted in agent/prompt_truncated); each reply
becomes the server's action (below), `step` answers with an observation, a reward and `done`; the observation's text
becomes the next user turn, appended as ids after the reply (observation tokens, mask 0: the chat template's turn
markers around it, exactly as the template renders a conversation); the episode ends at `done`, at --max_turns or
when --generate_max_len is used up. Its reward is the sum of the step rewards (--openenv_reward last: the last one).
The model samples through the gateway (in process: the rank's own engine, batched across episodes), so the row is
the session's ids (rlrun.environments.rows).

The reply as an action (the server's GET /schema): an action with one text field (besides `metadata`), or one required
text field and only optional others, gets the reply text in it; any other action schema gets the reply parsed as a
JSON object. An observation as text: its one text
field, or its fields as JSON. A server error, a malformed action or a dropped connection fails the episode (trains
nothing, counted).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import IO, Any

from transformers import PreTrainedTokenizerBase

from rlrun.agents.episodes import Episodes
from rlrun.config.agent import AgentConfig
from rlrun.config.generation import GenerationConfig
from rlrun.data.prompts import Prompts
from rlrun.data.sources import render
from rlrun.engines.protocol import Engine
from rlrun.environments.rows import (
    EpisodeFailed,
    EpisodeLimits,
    InProcessSessions,
    Outcome,
    episode_limits,
    finish,
    gateway_opener,
)
from rlrun.gateway.server import Gateway, Session
from rlrun.gateway.wire import Call
from rlrun.runtime.errors import ConfigError, MissingExtraError
from rlrun.runtime.secrets import redact_text

CONNECT_TIMEOUT_S = 30.0
# A full server (every session it may hold taken) is asked again after 0.1 s, doubling up to 2 s, within the
# episode's --agent_timeout
FULL_WAIT_S = 0.1
FULL_WAIT_MAX_S = 2.0
PROBE = ("\x00USER\x00", "\x00REPLY\x00", "\x00OBS\x00")  # marks no chat template or model writes


# ---- a server rlrun starts (--openenv_app) -------------------------------------------------------------------------
# `python -m uvicorn module:app` on loopback and a free port, on the engine rank that uses it, started when its
# episodes are built and stopped when the process ends (also when it is killed: the server is told to die with its
# parent). The interpreter is --openenv_python (default: this one): openenv 0.10 cannot share a venv with verifiers
# 0.4 (their mcp pins conflict), so a server often lives in a venv of its own.

START_TIMEOUT_S = 120.0  # an app's imports (FastAPI, openenv, its environment) on a busy node
OUTPUT_TAIL = 1500  # characters of a server's output kept for the message when it does not start
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the server's process before exec: SIGKILL when the rank that started it dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class AppServer:
    """A running server: its base URL, process and output (a file: a pipe nobody reads would fill and stall it)."""

    url: str
    process: subprocess.Popen
    output: IO[str]

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


def start_app(
    app: str, python: str | None = None, cwd: str | None = None, env: dict[str, str] | None = None
) -> AppServer:
    """Serve `app` (module:attribute, as uvicorn takes it; `cwd`, default this process's, is on its path) on a free
    loopback port; returns once GET /health answers, or raises one ConfigError with the server's last output."""
    if ":" not in app:
        raise ConfigError(f"--openenv_app {app!r} names no app; write module:attribute (e.g. my_env.server.app:app)")
    interpreter = python or sys.executable
    port = free_port("127.0.0.1")
    argv = [interpreter, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    output = tempfile.TemporaryFile(mode="w+")
    try:
        process = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    except OSError as exc:
        raise ConfigError(f"--openenv_app {app}: {interpreter} does not start ({exc}); see --openenv_python") from None
    server = AppServer(f"http://127.0.0.1:{port}", process, output)
    atexit.register(server.stop)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _healthy(server.url):
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            output.seek(0)
            out = output.read()[-OUTPUT_TAIL:]
            if process.returncode not in (None, -signal.SIGKILL):
                why = f"exited with status {process.returncode}"
            else:
                why = f"did not answer GET /health within {START_TIMEOUT_S:g}s"
            raise ConfigError(
                f"--openenv_app {app} ({interpreter} -m uvicorn) {why} ({' '.join(out.split()).rstrip('.')}); "
                "the module must import where the run starts (its folder on PYTHONPATH) in an interpreter with "
                "openenv and uvicorn (--openenv_python)"
            )
        time.sleep(0.3)
    return server


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


# ---- the server's schema -----------------------------------------------------------------------------------------


def text_field(schema: dict) -> str | None:
    """The action's text field: its one string field besides `metadata`, or its one required string field when the
    others have defaults; None when it has another shape (replies are then parsed as JSON)."""
    fields = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
    texts = [k for k, v in fields.items() if v.get("type") == "string"]
    required = [k for k in texts if k in (schema.get("required") or [])]
    needed = [k for k in fields if k in (schema.get("required") or [])]
    if len(fields) == 1 and len(texts) == 1:
        return texts[0]
    return required[0] if len(required) == 1 and needed == required else None


def action_of(reply: str, field: str | None) -> dict:
    """The server's action from the model's reply text (see the module docstring)."""
    if field is not None:
        return {field: reply}
    start, end = reply.find("{"), reply.rfind("}")
    try:
        action = json.loads(reply[start : end + 1]) if 0 <= start < end else None
    except ValueError:
        action = None
    if not isinstance(action, dict):
        raise EpisodeFailed(f"the reply {reply[:80]!r} is not a JSON object of the server's action")
    return action


def observation_text(observation: dict) -> str:
    fields = {k: v for k, v in observation.items() if k != "metadata"}
    texts = [v for v in fields.values() if isinstance(v, str)]
    return texts[0] if len(fields) == 1 and texts else json.dumps(fields, sort_keys=True, default=str)


def read_schema(url: str, source: str) -> str | None:
    """The action's text field from GET {url}/schema (None: replies are parsed as JSON); `source`: the flag that
    named the server."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/schema", timeout=CONNECT_TIMEOUT_S) as response:
            schema = json.loads(response.read())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{source}: GET {url}/schema failed ({exc}); start the OpenEnv server first (uvicorn "
            "pkg.server.app:app --port N) and pass its base URL, or let rlrun start it (--openenv_app "
            "pkg.server.app:app)"
        ) from None
    return text_field(schema.get("action") or {})


# ---- turns as ids ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bridge:
    """The chat template's text around a user turn that follows a reply: what comes after the reply (its end marker
    when the model did not sample it, the user header) and after the user's text (the generation prompt)."""

    before: str
    after: str
    end: str  # the reply's end marker as the template writes it (dropped when the model sampled it)

    def text(self, observation: str, reply_ended: bool) -> str:
        before = self.before[len(self.end) :] if reply_ended and self.before.startswith(self.end) else self.before
        return before + observation + self.after


def chat_bridge(tokenizer: PreTrainedTokenizerBase) -> Bridge:
    """The bridge, read off the template once by rendering a conversation of marker strings."""
    user, reply, obs = PROBE
    if not getattr(tokenizer, "chat_template", None):
        return Bridge("\n", "\n", "")
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    text = render(tokenizer, [*messages, {"role": "user", "content": obs}], True, "the chat template")
    between = text[text.index(reply) + len(reply) : text.index(obs)]
    eos = str(tokenizer.eos_token or "")
    return Bridge(between, text[text.index(obs) + len(obs) :], eos if between.startswith(eos) else "")


def first_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list, observation: str) -> list[int]:
    """The record's prompt with the reset observation appended to its last user message, through the template."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if observation:
        last = max((k for k, m in enumerate(messages) if m.get("role") == "user"), default=None)
        if last is None:
            messages.append({"role": "user", "content": observation})
        else:
            messages[last]["content"] = f"{messages[last]['content']}\n\n{observation}"
    if getattr(tokenizer, "chat_template", None):
        text = render(tokenizer, messages, True, "the episode's prompt")
    else:
        text = "\n\n".join(str(m["content"]) for m in messages) + "\n"
    return tokenizer.encode(text, add_special_tokens=False)


# ---- the episodes ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpenEnvSettings:
    url: str
    source: str  # the flag that named the server, for messages
    action_field: str | None  # None: replies are parsed as JSON
    last_reward: bool  # --openenv_reward last
    max_turns: int | None
    max_tokens: int  # per call


class OpenEnvEpisodes:
    """One engine rank's OpenEnv episodes: each a WebSocket session on the process's event loop for environments,
    its model calls queued on the gateway that this rank's thread serves."""

    def __init__(
        self,
        settings: OpenEnvSettings,
        limits: EpisodeLimits,
        tokenizer: PreTrainedTokenizerBase,
        open_gateway: Callable[[], Gateway],
    ) -> None:
        self.settings, self.limits, self.tokenizer = settings, limits, tokenizer
        self.sessions = InProcessSessions(open_gateway, limits)
        self.bridge = chat_bridge(tokenizer)

    def episodes(
        self, engine: Engine, prompts: Prompts, rows: list[int], prompt_ids: list[list[int]], seed: int
    ) -> Episodes:

        def episode(gateway: Gateway, session: Session, i: int, k: int) -> Coroutine[Any, Any, Outcome]:
            return self._one(gateway, session, prompts, i, k)

        built, outcomes = self.sessions.run(engine, seed, rows, prompt_ids, episode)
        groups = [prompts.texts[i] for i in rows]
        pad = int(self.tokenizer.pad_token_id)
        what = f"OpenEnv episodes ({self.settings.source})"
        return finish(built, outcomes, groups, self.limits.prompt_max_len, pad, what)

    async def _one(self, gateway: Gateway, session: Session, prompts: Prompts, i: int, k: int) -> Outcome:
        try:
            from websockets.asyncio.client import connect  # noqa: PLC0415 - the openenv extra's
        except ImportError:
            raise MissingExtraError("websockets", "openenv", "--openenv_url") from None
        s, record = self.settings, prompts.records[i]
        url = s.url.replace("http://", "ws://", 1).replace("https://", "wss://", 1).rstrip("/") + "/ws"
        label = {} if record.label is None else {"label": record.label}
        episode_id = f"rlrun-{self.sessions.phases}-{k}"
        reset = {"type": "reset", "data": {**label, **(record.extra_info or {}), "episode_id": episode_id}}
        for waits in itertools.count():
            async with connect(url, open_timeout=CONNECT_TIMEOUT_S, max_size=2**24) as ws:
                try:
                    observation, _, done = await _exchange(ws, reset)
                except ServerFull:  # its sessions are all taken (OpenEnv's default is one): wait for one
                    await asyncio.sleep(min(FULL_WAIT_MAX_S, FULL_WAIT_S * 2**waits))
                    continue
                rewards, cut = await self._play(gateway, session, ws, record.prompt, observation, done)
                await ws.send(json.dumps({"type": "close"}))
                break
        if not rewards:
            raise EpisodeFailed("the server said done at reset; there was nothing to act on")
        metrics = {"steps": float(len(rewards)), "prompt_truncated": cut, "server_full_waits": float(waits)}
        return Outcome(reward=rewards[-1] if s.last_reward else sum(rewards), metrics=metrics)

    async def _play(
        self, gateway: Gateway, session: Session, ws: Any, prompt: str | list, observation: dict, done: bool
    ) -> tuple[list[float], float]:
        """The episode's steps after its reset: the step rewards, and whether the first prompt was cut."""
        s = self.settings
        ids = first_prompt(self.tokenizer, prompt, observation_text(observation))
        cut = float(len(ids) > self.limits.prompt_max_len)  # keeps its last tokens, as agents' prompts do
        ids = ids[-self.limits.prompt_max_len :]
        rewards: list[float] = []
        while not done:
            call = Call(prompt=ids, max_tokens=min(s.max_tokens, self.limits.response_budget), logprobs=True)
            reply = await asyncio.get_running_loop().run_in_executor(None, gateway.submit, call, session)
            text = str(self.tokenizer.decode(reply.tokens, skip_special_tokens=True))
            observation, reward, done = await _exchange(ws, {"type": "step", "data": action_of(text, s.action_field)})
            rewards.append(reward)
            used = len(ids) + len(reply.tokens) - len(session.calls[0].call.prompt)
            if done or len(rewards) == s.max_turns or used >= self.limits.response_budget:
                break
            bridge = self.bridge.text(observation_text(observation), gateway.at_end(reply))
            ids = ids + reply.tokens + self.tokenizer.encode(bridge, add_special_tokens=False)
        return rewards, cut


class ServerFull(EpisodeFailed):
    """The server holds as many sessions as it may (OpenEnv's CAPACITY_REACHED)."""


async def _exchange(ws: Any, message: dict) -> tuple[dict, float, bool]:
    """One request of the session and its answer: (observation, reward, done), or EpisodeFailed with the server's
    error."""
    from websockets.exceptions import ConnectionClosed  # noqa: PLC0415 - the openenv extra's

    try:
        await ws.send(json.dumps(message))
    except ConnectionClosed:
        pass  # a server that refused the session (full) said why before it closed: read that below
    answer = json.loads(await ws.recv())
    data = answer.get("data") or {}
    if answer.get("type") != "observation":
        why = " ".join(str(data.get("message", data)).split())[:300]
        if data.get("code") == "CAPACITY_REACHED":
            raise ServerFull(why)
        raise EpisodeFailed(f"the server answered {message['type']} with {answer.get('type')}: {why}")
    reward = data.get("reward")
    return data.get("observation") or {}, float(reward) if reward is not None else 0.0, bool(data.get("done"))


def build_openenv_episodes(
    a: AgentConfig, g: GenerationConfig, tokenizer: PreTrainedTokenizerBase, model: str, slot: int
) -> OpenEnvEpisodes:
    """--openenv_url's episodes on engine rank number `slot`, or --openenv_app's on a server this rank starts (its
    gateway serves them in process; --gateway_port opens it to outside callers too)."""
    if a.openenv_app is not None:
        url, source = start_app(a.openenv_app, a.openenv_python).url, f"--openenv_app {a.openenv_app}"
    else:
        assert a.openenv_url is not None
        url, source = a.openenv_url, f"--openenv_url {redact_text(a.openenv_url)}"
    cap = a.max_tokens_per_turn or g.generate_max_len
    settings = OpenEnvSettings(url, source, read_schema(url, source), a.openenv_reward == "last", a.max_turns, cap)
    limits = episode_limits(a, g)
    return OpenEnvEpisodes(settings, limits, tokenizer, gateway_opener(a, g, tokenizer, model, slot, max_calls=False))
