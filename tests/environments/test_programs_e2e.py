"""A black-box agent program trains the demo policy through the token gateway: `rlrun.ppo --agent_command` on two
ranks, each engine rank serving its programs' chat and token-route calls (examples/agents/count_agent.py, two
turns with an observation between them)."""

from __future__ import annotations

import sys

import pytest
from helpers import REPO, run_rlrun

AGENT = REPO / "examples" / "agents" / "count_agent.py"  # docs/environments.md runs it too


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_agent_program_learns_through_the_gateway_and_its_rows_are_the_engines_tokens(tmp_path):
    """Reward rises (the program's own, printed on stdout); the rows are the calls' ids: up to 6 + 3 observation +
    6 tokens, and the engine's log-probs of the sampled ones are the actor's (< 1e-4; observation tokens, which the
    engine never sampled, would make this ~5 if they were counted as actions)."""
    args = ["--config", "configs/demo.yaml", "--agent_command", f"{sys.executable} {AGENT}", "--max_steps", "10",
            "--rollout_batch_size", "8", "--train_batch_size", "32"]
    res = run_rlrun(2, args, tmp_path)
    assert res.returncode == 0, res.output[-3000:]
    assert "reward: what each episode's --agent_command" in res.output
    rewards = [m["reward"] for m in res.metrics]
    assert len(rewards) == 10
    # 0.063 over the first three steps, 0.472 over the last three (each call's draws are keyed by its session and
    # call number, so the run is the same whichever calls the gateway batched together)
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards
    for m in res.metrics:
        assert m["agent/turns"] == 2 and m["agent/failed"] == 0 and m["agent/calls_off_branch"] == 0
        assert 5 <= m["response_length"] <= 15  # each turn 1-6 tokens (an end id may come early), 3 between
        assert m["rollout/engine_vs_actor_logprob_diff"] < 1e-4
