"""The multi-turn agent section (rlrun.ppo): OpenRLHF agent files and the built-in Search-R1 agent
(rlrun.agents)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlrun.config.fields import opt, positive
from rlrun.runtime.errors import ConfigError

RETRIEVER_RETRY_BACKOFF_S = 0.5  # the retriever client sleeps this * 2**(k-1) before retry k
# The sources of multi-turn episodes (one at most); the last four sample through the token gateway.
GATEWAY_SOURCES = ("agent_command", "env_id", "openenv_url", "openenv_app", "environment_factory")
EPISODE_SOURCES = ("agent_func_path", "retriever_url", *GATEWAY_SOURCES)


@dataclass
class AgentConfig:
    """Multi-turn agent rollouts: an environment answers each model turn (observation tokens are not actions)."""

    agent_func_path: str | None = opt(
        None,
        "OpenRLHF agent file (.py) defining AgentInstance (reset/step, async) and "
        "usually AgentExecutor; its rewards replace any reward source. Turns: see "
        "--max_turns.",
    )
    retriever_url: str | None = opt(
        None,
        "Built-in Search-R1 agent: the retrieval server's POST URL (e.g. "
        "http://127.0.0.1:8000/retrieve, see python -m rlrun.retriever_server); "
        "reward = exact match of the last <answer> against the label's golden "
        "answers.",
    )
    retriever_topk: int = opt(3, "Search-R1 agent: passages per search.")
    retriever_timeout: float = opt(
        10.0,
        "Search-R1 agent: seconds per retrieval request (tried --remote_rm_retries "
        "times with backoff, then the run fails naming the URL); all tries must fit "
        "in --agent_timeout.",
    )
    agent_command: str | None = opt(
        None,
        "A black-box agent program run once per episode (e.g. 'python my_agent.py'): it samples through the "
        "gateway's OpenAI API (OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL set for it), reads its prompt row "
        'as one JSON line on stdin and prints {"reward": x} last; its calls\' exact ids are the training row '
        "(docs/environments.md).",
    )
    env_id: str | None = opt(
        None,
        "A verifiers 0.4 taskset id (prime-rl's env.taskset.id): an importable module or package whose __all__ "
        "exports one Taskset. Its tasks are the prompts; each episode runs through the token gateway "
        "(docs/environments.md).",
    )
    env_harness: str = opt(
        "rlrun-chat",
        "The verifiers harness of --env_id's episodes, in every seat (prime-rl's env.<seat>.harness.id): rlrun's "
        "in-process chat harness (no network).",
    )
    env_args: str | None = opt(None, "--env_id's taskset config fields, as a JSON object.")
    openenv_url: str | None = opt(
        None,
        "A running OpenEnv server's base URL (e.g. http://127.0.0.1:8000): each episode is one WebSocket session "
        "(reset with the record's extra_info, one step per model reply; docs/environments.md).",
    )
    environment_factory: str | None = opt(
        None,
        "A TRL environment class (TRL's environment_factory), as module:Class or path/to/file.py:Class: one "
        "instance per episode, reset(**row), its public methods the model's tools (called through the chat "
        "template's tool calls), get_reward() its reward (docs/environments.md).",
    )
    openenv_app: str | None = opt(
        None,
        "An OpenEnv server's app as uvicorn takes it (module:app, e.g. my_env.server.app:app): each engine rank "
        "starts one on loopback (python -m uvicorn, --openenv_python) and stops it at the end; then as --openenv_url.",
    )
    openenv_python: str | None = opt(
        None, "The interpreter that runs --openenv_app's server (a venv with openenv and uvicorn); default: this one."
    )
    openenv_reward: Literal["sum", "last"] = opt(
        "sum", "An OpenEnv episode's reward: the sum of its step rewards, or the last."
    )
    gateway_host: str = opt(
        "127.0.0.1",
        "Address the token gateway of each engine rank listens on (--agent_command); 0.0.0.0 for every "
        "interface. Requests need the run's key as a bearer token.",
    )
    gateway_port: int = opt(
        0, "Port of the first engine rank's token gateway (engine rank k: this + k); 0 picks a free port."
    )
    max_turns: int | None = opt(
        None,
        "Most model turns per episode (each turn generates, then the agent steps). "
        "Unset: until the agent says done or --generate_max_len is used up. Search-R1's "
        "max_turns=K is K search turns plus a final answer turn, i.e. --max_turns K+1.",
    )
    max_tokens_per_turn: int | None = opt(
        None,
        "Most tokens generated in one turn (Search-R1's per-turn "
        "max_response_length). Unset: what is left of --generate_max_len.",
    )
    max_obs_len: int | None = opt(
        None,
        "Most tokens of one observation (verl/Search-R1 max_obs_length); longer ones "
        "keep their first tokens and are counted in agent/obs_truncated.",
    )
    state_masking: bool = opt(
        True,
        "Observation tokens carry no loss, KL or advantage (Search-R1 state_masking). "
        "false: they are trained on like generated tokens.",
    )
    agent_timeout: float = opt(60.0, "Seconds one agent reset() or step() call may take before the run fails.")
    agent_max_concurrency: int = opt(64, "Agent calls of one engine rank that run at once (asyncio).")

    @property
    def multi_turn(self) -> bool:
        """Rollouts are agent episodes (their rewards are the reward)."""
        return any(getattr(self, n) is not None for n in EPISODE_SOURCES)

    @property
    def adds_reward_function(self) -> bool:
        """The chosen source's episodes take the run's reward function besides their own reward (TRL classes, as
        TRL adds reward_funcs; agent programs)."""
        return self.environment_factory is not None or self.agent_command is not None

    @property
    def gateway_source(self) -> str | None:
        """The flag of the chosen source that samples through the token gateway (None: no such source)."""
        return next((f"--{n}" for n in GATEWAY_SOURCES if getattr(self, n) is not None), None)

    def check(self) -> None:
        for name in ("max_turns", "max_tokens_per_turn", "max_obs_len"):
            positive(name, getattr(self, name), allow_none=True)
        for name in ("retriever_topk", "retriever_timeout", "agent_timeout", "agent_max_concurrency"):
            positive(name, getattr(self, name))
        chosen = [f"--{n} {v}" for n in EPISODE_SOURCES if (v := getattr(self, n)) is not None]
        if len(chosen) > 1:
            raise ConfigError(
                f"{' and '.join(chosen)} are all set; each runs the episodes its own way (--retriever_url: the "
                "built-in Search-R1 agent): choose one agent"
            )
        if self.agent_command is not None and self.max_obs_len is not None:
            raise ConfigError(
                f"--max_obs_len {self.max_obs_len} with --agent_command: a program's observations are whatever its "
                "next request adds to the conversation, never cut by rlrun; drop --max_obs_len"
            )
        if self.openenv_python is not None and self.openenv_app is None:
            raise ConfigError(
                f"--openenv_python {self.openenv_python} runs --openenv_app's server; add --openenv_app module:app "
                "or drop it"
            )
        if not 0 <= self.gateway_port < 65536:
            raise ConfigError(f"--gateway_port {self.gateway_port} is not a port; use 0 (a free one) to 65535")
        if not self.multi_turn:
            turn_flags = [
                f"--{n}" for n in ("max_turns", "max_tokens_per_turn", "max_obs_len") if getattr(self, n) is not None
            ]
            turn_flags += [] if self.state_masking else ["--state_masking false"]
            if turn_flags:
                raise ConfigError(
                    f"{', '.join(turn_flags)} shape multi-turn agent episodes; add --agent_func_path FILE.py, "
                    "--retriever_url URL or --agent_command PROGRAM, or drop them"
                )
