"""An OpenEnv server trains the demo policy: `rlrun.ppo --openenv_app module:app` on two ranks, each engine rank
starting its own real OpenEnv 0.10 server (tests/environments/openenv_chars_server.py, uvicorn in the OpenEnv lane:
--openenv_python) and speaking to it as to any --openenv_url; two steps per episode, the reset told each prompt's
label."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import run_rlrun, subprocess_env
from openenv_lane import OPENENV_PYTHON, needs_openenv


@needs_openenv
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_openenv_server_s_episodes_learn(tmp_path):
    """The summed step rewards rise (0.15 over the first three steps, 0.96 over the last three when measured); each
    episode took its two steps; the replies' engine log-probs are the actor's (the observation tokens between them
    are not counted as actions). Some prompts with the reset's observation run past the demo's --prompt_max_len 64:
    they keep their last tokens (agent/prompt_truncated) rather than fail."""
    here = str(Path(__file__).resolve().parent)
    args = ["--config", "configs/demo.yaml", "--openenv_app", "openenv_chars_server:app", "--openenv_python",
            str(OPENENV_PYTHON), "--max_steps", "20", "--rollout_batch_size", "8", "--train_batch_size", "32",
            "--generate_max_len", "48", "--max_tokens_per_turn", "6"]
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
    res = run_rlrun(2, args, tmp_path, env=subprocess_env(PYTHONPATH=path))
    assert res.returncode == 0, res.output[-3000:]
    assert "reward: the sum of the step rewards of --openenv_app openenv_chars_server:app" in res.output
    rewards = [m["reward"] for m in res.metrics]
    assert len(rewards) == 20
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.4, rewards
    for m in res.metrics:
        assert m["agent/steps"] == 2 and m["agent/turns"] == 2 and m["agent/failed"] == 0
        assert m["rollout/engine_vs_actor_logprob_diff"] < 1e-4
    assert any(m["agent/prompt_truncated"] > 0 for m in res.metrics)
