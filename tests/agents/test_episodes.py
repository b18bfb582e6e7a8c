"""The multi-turn episode runner, token by token.

The engine is a scripted stand-in (it returns fixed token lists, so the expected masks can be written
out by hand); the agents, the loop, the tokenizer and the asyncio calls are rlrun's real code."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from rlrun.agents.calls import AgentCalls
from rlrun.agents.episodes import EpisodeRunner, TurnLimits, mean_stats
from rlrun.engines.protocol import Generation
from rlrun.models.tiny import build_byte_tokenizer
from rlrun.runtime.errors import AgentError

TOK = build_byte_tokenizer()


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


class ScriptedEngine:
    """turns[t][row of the call] -> the text that row "generates" on call t (stand-in for a model)."""

    def __init__(self, turns: list[list[str]], log_probs: bool = True) -> None:
        self.turns, self.log_probs, self.calls = turns, log_probs, []

    def sample(self, prompts, seed, *, max_new_tokens=None, stop=()):
        self.calls.append((prompts, seed, max_new_tokens, stop))
        texts = self.turns[len(self.calls) - 1]
        out = [ids(t)[:max_new_tokens] for t in texts[:len(prompts)]]
        return Generation(out, [[-0.5] * len(r) for r in out] if self.log_probs else None)


class EchoAgent:
    """Feedback "[obs N]" after every turn, done after `turns` turns; reward 1 per turn whose action says "ok"."""

    def __init__(self, turns: int = 2, feedback: str = "[obs {n}]") -> None:
        self.n, self.turns, self.feedback = 0, turns, feedback

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.n += 1
        done = self.n >= self.turns
        return {"rewards": torch.tensor(float("ok" in states["action_text"])), "environment_feedback":
                "" if done else self.feedback.format(n=self.n), "done": done, "extra_logs": {"steps": self.n}}


def runner(factory, **limits) -> EpisodeRunner:
    lim = dict(response_budget=64, prompt_max_len=16) | limits
    return EpisodeRunner(factory, TOK, TurnLimits(**lim), AgentCalls(timeout_s=5, max_concurrency=4, source="test"))


def test_two_turns_masks_log_probs_rewards_by_hand() -> None:
    engine = ScriptedEngine([["ok!", "no"], ["fine ok", "ok"]])
    eps = runner(lambda: EchoAgent(turns=2)).run(engine, ["Q1", "Q2"], [ids("Q1"), ids("Q2")], ["a", None], seed=7)
    # row 0: "ok!" (3 actions) + "[obs 1]" (7 observation bytes) + "fine ok" (7 actions)
    assert eps.responses[0] == ids("ok![obs 1]fine ok")
    assert eps.action_masks[0] == [1] * 3 + [0] * 7 + [1] * 7
    assert eps.log_probs[0] == [-0.5] * 3 + [0.0] * 7 + [-0.5] * 7
    assert eps.responses[1] == ids("no[obs 1]ok") and eps.action_masks[1] == [1, 1] + [0] * 7 + [1, 1]
    assert eps.rewards.tolist() == [2.0, 1.0]
    assert eps.truncated == [False, False]
    # Turn 2 continued from prompt + everything so far, with its own seed.
    assert engine.calls[1][0][0] == ids("Q1ok![obs 1]") and engine.calls[0][1] != engine.calls[1][1]
    stats = mean_stats([eps.stats])
    assert stats == {"agent/budget_cut": 0.0, "agent/obs_truncated": 0.0, "agent/observation_tokens": 7.0,
                     "agent/steps": 2.0, "agent/turns": 2.0}


def test_done_rows_leave_the_batch_and_max_turns_ends_the_rest() -> None:
    class DoneWhenOk(EchoAgent):
        async def step(self, states, **kwargs):
            out = await super().step(states)
            out["done"] = "ok" in states["action_text"]
            out["environment_feedback"] = "" if out["done"] else "?"
            return out
    engine = ScriptedEngine([["ok", "x"], ["y"], ["z"]])
    eps = runner(lambda: DoneWhenOk(turns=99), max_turns=2).run(engine, ["A", "B"], [ids("A"), ids("B")], [None, None], 0)
    assert [len(c[0]) for c in engine.calls] == [2, 1]  # row 0 finished after turn 1; max_turns stopped row 1
    assert eps.responses[1] == ids("x?y") and eps.action_masks[1] == [1, 0, 1]
    assert eps.truncated == [False, False]  # max_turns is not a budget cut


def test_budget_caps_turns_observations_and_is_reported() -> None:
    engine = ScriptedEngine([["abcdef"], ["ghijkl"]])
    eps = runner(lambda: EchoAgent(turns=5, feedback="0123456789"), response_budget=12, max_tokens_per_turn=4,
                 max_obs_len=6).run(engine, ["P"], [ids("P")], [None], 0)
    # turn 1: 4 tokens (per-turn cap); observation cut to 6 (max_obs_len); turn 2: the 2 tokens left.
    assert engine.calls[0][2] == 4 and engine.calls[1][2] == 2
    assert eps.responses[0] == ids("abcd012345gh") and eps.action_masks[0] == [1] * 4 + [0] * 6 + [1] * 2
    assert eps.truncated == [True]
    assert eps.stats["obs_truncated"] == 1.0 and eps.stats["budget_cut"] == 1.0


def test_state_masking_off_trains_on_observations() -> None:
    eps = runner(lambda: EchoAgent(turns=2), state_masking=False).run(
        ScriptedEngine([["a"], ["b"]]), ["P"], [ids("P")], [None], 0)
    assert eps.action_masks[0] == [1] * len(ids("a[obs 1]b"))


def test_reset_may_rewrite_the_prompt_and_it_is_left_truncated() -> None:
    class Rewrites(EchoAgent):
        async def reset(self, states, **kwargs):
            return {"observation": "SYSTEM: be brief. " + states["observation"]}
    engine = ScriptedEngine([["ok"]])
    eps = runner(lambda: Rewrites(turns=1), prompt_max_len=10).run(engine, ["Q"], [ids("Q")], [None], 0)
    assert eps.prompts[0] == ids("SYSTEM: be brief. Q")[-10:] and engine.calls[0][0][0] == eps.prompts[0]


def test_no_engine_log_probs_gives_none() -> None:
    eps = runner(lambda: EchoAgent(turns=1)).run(ScriptedEngine([["ok"]], log_probs=False), ["P"], [ids("P")], [None], 0)
    assert eps.log_probs is None


def test_async_init_of_openrlhf_examples_is_supported() -> None:
    class AsyncInit(EchoAgent):
        async def __init__(self):  # OpenRLHF's documented example declares this
            EchoAgent.__init__(self, turns=1)
    eps = runner(AsyncInit).run(ScriptedEngine([["ok"]]), ["P"], [ids("P")], [None], 0)
    assert eps.rewards.tolist() == [1.0]


@pytest.mark.parametrize("result, message", [
    ("not a dict", "must return a dict"),
    ({"rewards": 1.0, "done": True}, "without 'environment_feedback'"),
    ({"rewards": float("nan"), "environment_feedback": "", "done": True}, "must be finite"),
    ({"rewards": [1, 2], "environment_feedback": "", "done": True}, "must be a number"),
    ({"rewards": 1.0, "environment_feedback": 3, "done": True}, "must be text"),
    ({"rewards": 1.0, "environment_feedback": "", "done": True, "sampling_params": {"temperature": 0}},
     "new 'sampling_params'"),
])
def test_malformed_step_results_are_one_clear_error(result, message) -> None:
    class Bad(EchoAgent):
        async def step(self, states, **kwargs):
            return result
    with pytest.raises(AgentError, match=message) as err:
        runner(Bad).run(ScriptedEngine([["x"]]), ["P"], [ids("P")], [None], 0)
    assert "\n" not in str(err.value) and "episode 0, turn 0" in str(err.value)


def test_raising_agent_is_one_line_naming_the_call() -> None:
    class Raises(EchoAgent):
        async def step(self, states, **kwargs):
            raise KeyError("missing\nmultiline")
    with pytest.raises(AgentError, match=r"agent test step\(\) of turn 0 of episode 0 raised KeyError") as err:
        runner(Raises).run(ScriptedEngine([["x"]]), ["P"], [ids("P")], [None], 0)
    assert "\n" not in str(err.value)


@pytest.mark.timeout(30)
def test_slow_and_blocking_agents_time_out() -> None:
    class Slow(EchoAgent):
        async def step(self, states, **kwargs):
            await asyncio.sleep(60)

    class Blocks(EchoAgent):
        async def step(self, states, **kwargs):
            time.sleep(3)  # blocks the event loop: wait_for cannot interrupt it, the outer deadline does
            return {}

    def fast_runner(factory):
        return EpisodeRunner(factory, TOK, TurnLimits(64, 16), AgentCalls(timeout_s=0.5, max_concurrency=2, source="t"))

    with pytest.raises(AgentError, match="took longer than --agent_timeout 0.5s"):
        fast_runner(Slow).run(ScriptedEngine([["x"]]), ["P"], [ids("P")], [None], 0)
    started = time.monotonic()
    with pytest.raises(AgentError):
        fast_runner(Blocks).run(ScriptedEngine([["x"]]), ["P"], [ids("P")], [None], 0)
    assert time.monotonic() - started < 10


def test_concurrency_is_bounded() -> None:
    live, peak = [0], [0]

    class Counts(EchoAgent):
        async def step(self, states, **kwargs):
            live[0] += 1
            peak[0] = max(peak[0], live[0])
            await asyncio.sleep(0.05)
            live[0] -= 1
            return await super().step(states)
    n = 10
    runner(lambda: Counts(turns=1)).run(ScriptedEngine([["ok"] * n]), ["P"] * n, [ids("P")] * n, [None] * n, 0)
    assert peak[0] == 4  # AgentCalls(max_concurrency=4)
