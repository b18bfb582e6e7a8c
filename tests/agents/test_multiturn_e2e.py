"""Multi-turn agent episodes through the whole trainer (torchrun, gloo, the tiny model)."""

from __future__ import annotations

import pytest

from helpers import run_rlrun

DEMO = ["--config", "configs/multiturn_demo.yaml"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multiturn_demo_learns_to_follow_the_observation(tmp_path):
    """The example environment (an unchanged OpenRLHF agent file): the reward rises, and turn 2, rewarded
    only for following the environment's reply (the opposite of the prompt's request), is learned too."""
    res = run_rlrun(1, DEMO, tmp_path)
    assert res.returncode == 0, res.output[-3000:]
    rewards = [m["reward"] for m in res.metrics]
    turn2 = [m["agent/turn2_reward"] for m in res.metrics]
    assert len(rewards) == 40
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.4, rewards
    # at most 0.5 (half of the episode's reward); over the last three steps seeds 42, 1 and 2 end at 0.26, 0.25 and
    # 0.50, from at most 0.07 over the first three
    assert sum(turn2[-3:]) / 3 > 0.2 > sum(turn2[:3]) / 3, turn2
    first = res.metrics[0]
    assert first["agent/turns"] == 2.0 and first["agent/observation_tokens"] >= 12  # "\nNow digits:" is 12 bytes
    assert first["agent/budget_cut"] == 0.0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_disaggregated_engine_ranks_send_their_masks(tmp_path):
    """Engines on ranks 2-3, actor on 0-1 with a critic (GAE), packed rows: the masks travel with the rollouts,
    the agents' stats are merged over both engine ranks, and evaluation runs episodes too."""
    evals = tmp_path / "eval.jsonl"
    evals.write_text('{"prompt": "Type a few digits:", "label": "digits"}\n{"prompt": "Say letters:", "label": "letters"}\n')
    res = run_rlrun(4, DEMO + ["--max_steps", "2", "--actor_num_gpus_per_node", "1", "--critic_num_gpus_per_node", "1",
                               "--vllm_num_engines", "2", "--advantage_estimator", "gae", "--init_kl_coef", "0.01",
                               "--eval_dataset", str(evals), "--input_key", "prompt", "--label_key", "label",
                               "--eval_steps", "2", "--eval_n_samples_per_prompt", "1", "--packing_samples"],
                    tmp_path / "out")
    assert res.returncode == 0, res.output[-3000:]
    assert [(m["step"], "eval/reward" in m) for m in res.metrics] == [(1, False), (2, False), (2, True)]
    m, ev = res.metrics[1], res.metrics[2]
    assert m["agent/turns"] == 2.0 and "critic/value_loss" in m and m["kl"] >= 0
    assert ev["eval/num_samples"] == 2.0 and ev["eval/response_length"] > 12  # two turns and an observation


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_agent_that_raises_is_one_line_and_a_nonzero_exit(tmp_path):
    res = run_rlrun(2, DEMO + ["--max_steps", "2", "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1",
                               "--agent_func_path", "tests/fixtures/agent_raises.py"], tmp_path)
    assert res.returncode != 0
    failed = [line for line in res.output.splitlines() if "FAILED (engine)" in line]
    assert len(failed) == 1 and failed[0].endswith("step() of turn 1 of episode 0 raised RuntimeError: tool crashed"), res.output[-2000:]
    assert "rlrun/agents" not in res.output  # no traceback through rlrun (torchrun prints its own launcher's)
