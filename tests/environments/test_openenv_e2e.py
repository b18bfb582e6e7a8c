"""An OpenEnv server trains the demo policy: `rlrun.ppo --openenv_url URL` on two ranks against a real OpenEnv 0.10
server (tests/environments/openenv_chars_server.py, uvicorn in the OpenEnv lane), two steps per episode, the reset
told each prompt's label."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_rlrun
from openenv_lane import needs_openenv, openenv_server


@needs_openenv
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_openenv_server_s_episodes_learn(tmp_path):
    """The summed step rewards rise (0.15 over the first three steps, 0.96 over the last three when measured); each
    episode took its two steps; the replies' engine log-probs are the actor's (the observation tokens between them
    are not counted as actions). Some prompts with the reset's observation run past the demo's --prompt_max_len 64:
    they keep their last tokens (agent/prompt_truncated) rather than fail."""
    with openenv_server("openenv_chars_server:app", Path(__file__).resolve().parent) as url:
        args = ["--config", "configs/demo.yaml", "--openenv_url", url, "--max_steps", "20", "--rollout_batch_size",
                "8", "--train_batch_size", "32", "--generate_max_len", "48", "--max_tokens_per_turn", "6"]
        res = run_rlrun(2, args, tmp_path)
    assert res.returncode == 0, res.output[-3000:]
    assert "reward: the sum of the OpenEnv server's step rewards" in res.output
    rewards = [m["reward"] for m in res.metrics]
    assert len(rewards) == 20
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.4, rewards
    for m in res.metrics:
        assert m["agent/steps"] == 2 and m["agent/turns"] == 2 and m["agent/failed"] == 0
        assert m["rollout/engine_vs_actor_logprob_diff"] < 1e-4
    assert any(m["agent/prompt_truncated"] > 0 for m in res.metrics)
