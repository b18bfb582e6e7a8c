"""A TRL environment class trains the demo policy: `rlrun.ppo --environment_factory FILE.py:Class` on two ranks with
the class file as a TRL user writes it (examples/trl_env/chars_env.py, docs/environments.md's example), its get_reward() added to the run's
reward function (--remote_rm_url demo), as TRL adds an environment's reward to its reward_funcs."""

from __future__ import annotations

import pytest
from helpers import run_rlrun

@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_trl_environment_class_s_episodes_learn(tmp_path):
    """The reward (get_reward's 0.5 + the demo rule's share) rises (0.58 over the first three steps, 1.00 over the last
    three when measured); every episode was reset with its row's label
    (else get_reward gives 0) and made one model call (the demo model calls no tool); the replies' engine log-probs
    are the actor's."""
    args = ["--config", "configs/demo.yaml", "--environment_factory", "examples/trl_env/chars_env.py:CharsEnv",
            "--remote_rm_url", "demo", "--max_steps", "12", "--rollout_batch_size", "8", "--train_batch_size", "32"]
    res = run_rlrun(2, args, tmp_path)
    assert res.returncode == 0, res.output[-3000:]
    assert "reward: get_reward() of --environment_factory" in res.output
    rewards = [m["reward"] for m in res.metrics]
    assert len(rewards) == 12 and min(rewards) >= 0.5
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards
    for m in res.metrics:
        assert m["agent/turns"] == 1 and m["agent/failed"] == 0 and m["agent/tool_calls"] == 0
        assert m["rollout/engine_vs_actor_logprob_diff"] < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_trl_environment_class_s_episodes_run_on_an_async_engine_rank(tmp_path):
    """--async_train with the engine on a rank of its own and a LoRA policy (the engine gets the merged weights): the
    gateway serves the episodes while the actor trains; step 1's rows come from the actor's own weights, later ones
    from the previous version (the lag shows in the engine-vs-actor log-prob gap, as async training's does), and
    OpenRLHF's rollout correction weighs them by the gateway's engine log-probs."""
    args = ["--config", "configs/demo.yaml", "--environment_factory", "examples/trl_env/chars_env.py:CharsEnv",
            "--remote_rm_url", "demo", "--max_steps", "5", "--rollout_batch_size", "8", "--train_batch_size", "32",
            "--async_train", "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1",
            "--generation_backend", "native", "--lora_rank", "8", "--enable_vllm_is_correction"]
    res = run_rlrun(2, args, tmp_path)
    assert res.returncode == 0, res.output[-3000:]
    assert "saved the policy as a LoRA adapter" in res.output
    assert len(res.metrics) == 5 and all(m["agent/failed"] == 0 and m["reward"] >= 0.5 for m in res.metrics)
    gaps = [m["rollout/engine_vs_actor_logprob_diff"] for m in res.metrics]
    assert gaps[0] < 1e-4 and all(g > 1e-3 for g in gaps[1:]), gaps
    weights = [(m["rollout_corr/rollout_is_mean"], m["rollout_corr/rollout_is_std"]) for m in res.metrics]
    assert weights[0] == (1.0, 0.0) and all(std > 0 for _, std in weights[1:]), weights
