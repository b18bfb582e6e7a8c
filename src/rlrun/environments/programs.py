"""Black-box agent programs (--agent_command): each episode is one run of the user's program, which talks to the
model only through the OpenAI API of a gateway session (rlrun.gateway), and says its reward on stdout.

The program gets, per episode:
  * OPENAI_BASE_URL (the session's `.../s/<id>/v1`), OPENAI_API_KEY (the run's gateway key) and OPENAI_MODEL;
  * on stdin one JSON line: {"prompt": the record's prompt as the data holds it (text or a message list),
    "text": the prompt as the policy sees it (templated), "label", "data_source", "extra_info", "index"};
and prints, as the last line of its stdout, {"reward": x} (a finite number). With a reward function set
(--remote_rm_url, --compute_score), its score over the record and the session's decoded response is added; a program
that prints no reward line then has that score alone.

The training row is built from the session's calls, never from the program's text: the first call's prompt ids are
the row's prompt; each call's sampled ids are actions (the engine's log-probs kept); the ids between one call's
reply and the next call's prompt (the tool results and turn markers the program's next request added) are
observation tokens (mask 0). A call whose prompt does not extend the previous call's prompt + reply (the program
re-rendered or edited its history) starts a new branch, which rlrun does not train yet: the episode keeps its first
branch, and the calls left out are counted (agent/calls_off_branch).

A failed episode (non-zero exit, no reward line, more than --agent_timeout seconds, no model call, a prompt over
--prompt_max_len) trains nothing: its action mask is all zeros and its reward is the mean of its prompt group's
good episodes, so it moves neither the loss nor its group's baseline; agent/failed counts them, and a batch where
more than half fail ends the run with the first failure's reason.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from transformers import PreTrainedTokenizerBase

from rlrun.agents.episodes import Episodes
from rlrun.config.agent import AgentConfig
from rlrun.config.generation import GenerationConfig
from rlrun.data.prompts import Prompts
from rlrun.engines.protocol import Engine
from rlrun.environments.rows import (
    EpisodeLimits,
    Outcome,
    Row,
    add_transcript_rewards,
    branch_row,
    episode_limits,
    finish,
    gateway_opener,
)
from rlrun.gateway.server import Gateway, Session
from rlrun.rewards.reward_fn import RewardFunction

STDERR_TAIL = 300  # characters of a failed program's stderr kept for its message


def parse_reward(stdout: str) -> float:
    """The reward of the last non-empty stdout line, {"reward": x}; ValueError naming what is wrong."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError('printed nothing; its last stdout line must be {"reward": <number>}')
    last = lines[-1].strip()
    try:
        value = json.loads(last)
    except ValueError:
        raise ValueError(f'last stdout line {last[:120]!r} is not JSON; print {{"reward": <number>}} last') from None
    reward = value.get("reward") if isinstance(value, dict) else None
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f'last stdout line {last[:120]!r} has no finite number "reward"')
    return float(reward)


class ProgramEpisodes:
    """The episodes of one engine rank's agent programs, sampled through its gateway."""

    def __init__(
        self,
        command: str,
        limits: EpisodeLimits,
        tokenizer: PreTrainedTokenizerBase,
        reward_fn: RewardFunction | None,
        open_gateway: Callable[[], Gateway],
    ) -> None:
        self.argv = shlex.split(command)
        self.limits, self.tokenizer, self.reward_fn = limits, tokenizer, reward_fn
        self._open_gateway = open_gateway  # started with the first episodes: the port is taken on the engine rank
        self.gateway: Gateway | None = None
        self.phases = 0  # rollout phases run: the weight version answers name

    def episodes(
        self, engine: Engine, prompts: Prompts, rows: list[int], prompt_ids: list[list[int]], seed: int
    ) -> Episodes:
        """Run one program per row (at most max_concurrency at once) while this thread samples their requests."""
        if self.gateway is None:
            self.gateway = self._open_gateway()
        gateway = self.gateway
        sessions = [gateway.open_session() for _ in rows]
        with ThreadPoolExecutor(self.limits.max_concurrency, thread_name_prefix="rlrun-program") as pool:
            runs: list[Future[Outcome]] = [
                pool.submit(self._run, session, self._stdin(prompts, i, k))
                for k, (i, session) in enumerate(zip(rows, sessions))
            ]
            gateway.serve(engine, seed, self.phases, until=lambda: all(r.done() for r in runs))
            outcomes = [r.result() for r in runs]
        for session in sessions:
            gateway.close_session(session)
        self.phases += 1
        return self._rows(prompts, rows, prompt_ids, sessions, outcomes)

    def _stdin(self, prompts: Prompts, i: int, index: int) -> bytes:
        record = prompts.records[i]
        line = {
            "prompt": record.prompt,
            "text": prompts.texts[i],
            "label": record.label,
            "data_source": record.data_source,
            "extra_info": record.extra_info,
            "index": index,
        }
        return (json.dumps(line, default=str) + "\n").encode("utf-8")

    def _run(self, session: Session, stdin: bytes) -> Outcome:
        """One program, start to exit, bounded by --agent_timeout (its whole process group is killed then)."""
        assert self.gateway is not None
        env = {
            **os.environ,
            "OPENAI_BASE_URL": session.base_url,
            "OPENAI_API_KEY": self.gateway.token,
            "OPENAI_MODEL": self.gateway.limits.model,
        }
        try:
            proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,  # its children are killed with it
            )
        except OSError as exc:
            return Outcome(error=f"--agent_command {shlex.join(self.argv)} cannot start: {exc}")
        try:
            out, err = proc.communicate(stdin, timeout=self.limits.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Outcome(error=f"ran longer than --agent_timeout {self.limits.timeout_s:g}s and was killed")
        if proc.returncode != 0:
            tail = " ".join(err.decode("utf-8", "replace").split())[-STDERR_TAIL:]
            return Outcome(error=f"exited with status {proc.returncode}" + (f" ({tail})" if tail else ""))
        try:
            return Outcome(reward=parse_reward(out.decode("utf-8", "replace")))
        except ValueError as exc:  # no reward line: the reward function's score alone, when there is one
            return Outcome() if self.reward_fn is not None else Outcome(error=str(exc))

    def _rows(
        self,
        prompts: Prompts,
        rows: list[int],
        prompt_ids: list[list[int]],
        sessions: list[Session],
        outcomes: list[Outcome],
    ) -> Episodes:
        built: list[Row] = []
        for ids, session, outcome in zip(prompt_ids, sessions, outcomes):
            row = branch_row(session.calls, self.limits) if session.calls else Row(prompt=list(ids))
            if outcome.error is None and not session.calls:
                outcome.error = "made no model call through OPENAI_BASE_URL"
            built.append(row)
        if self.reward_fn is not None:
            add_transcript_rewards(self.reward_fn, prompts, rows, built, outcomes, self.tokenizer)
        what = f"agent program episodes (--agent_command {shlex.join(self.argv)})"
        groups = [prompts.texts[i] for i in rows]
        return finish(built, outcomes, groups, self.limits.prompt_max_len, int(self.tokenizer.pad_token_id), what)


def build_program_episodes(
    a: AgentConfig,
    g: GenerationConfig,
    tokenizer: PreTrainedTokenizerBase,
    reward_fn: RewardFunction | None,
    model: str,
    slot: int,
) -> ProgramEpisodes:
    """--agent_command's episodes on engine rank number `slot`, whose gateway serves `model` (the name its programs
    see in OPENAI_MODEL) on --gateway_port + slot (a free port when --gateway_port is 0). `reward_fn`: the run's
    reward function when one is set, added to each program's printed reward (or alone, when it prints none)."""
    assert a.agent_command is not None
    limits = episode_limits(a, g)
    opener = gateway_opener(a, g, tokenizer, model, slot, max_calls=True)
    return ProgramEpisodes(a.agent_command, limits, tokenizer, reward_fn, opener)
