"""A verifiers 0.4 taskset trains the demo policy: `rlrun.ppo --env_id chars_taskset` on two ranks, as a
prime-rl user names an environment (its taskset id: a package on the Python path, here examples/tasksets through
PYTHONPATH), each
engine rank running verifiers episodes whose calls its token gateway serves. The ranks are forked from the session's
pre-imported process, which puts PYTHONPATH's entries on their path as a fresh interpreter would."""

from __future__ import annotations

import os
import pytest
from helpers import REPO, run_rlrun, subprocess_env

TASKSETS = REPO / "examples" / "tasksets"  # docs/environments.md's command puts it on PYTHONPATH the same way


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_taskset_learns_through_the_gateway(tmp_path):
    """The rubric's reward rises; each row is verifiers' own branch (the engine's log-probs of it equal the actor's
    to < 1e-4); the rubric's score and metric reach the step metrics."""
    env = subprocess_env(PYTHONPATH=os.pathsep.join([str(TASKSETS), os.environ.get("PYTHONPATH", "")]))
    args = ["--config", "configs/demo.yaml", "--env_id", "chars_taskset", "--max_steps", "10",
            "--rollout_batch_size", "8", "--train_batch_size", "32", "--generate_max_len", "12"]
    res = run_rlrun(2, args, tmp_path, env=env)
    assert res.returncode == 0, res.output[-3000:]
    assert "reward: the rubric of the verifiers taskset --env_id chars_taskset" in res.output
    rewards = [m["reward"] for m in res.metrics]
    assert len(rewards) == 10
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards
    for m in res.metrics:
        assert m["agent/failed"] == 0 and m["agent/turns"] == 1
        assert m["agent/reward/share"] == pytest.approx(m["reward"], abs=1e-5)
        assert m["agent/metric/length"] > 0
        assert m["rollout/engine_vs_actor_logprob_diff"] < 1e-4
