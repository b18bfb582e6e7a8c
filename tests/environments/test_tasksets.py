"""verifiers 0.4 tasksets (--env_id) on one engine rank, in process: the real verifiers (its loader, Env, training
client with its own chat rendering, interception server, rubric) and renderers, rlrun's gateway over HTTP and its
native engine. The taskset (examples/tasksets/chars_taskset, on the path below) is written as verifiers' users write
one."""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import REPO, SHARP_TEMPERATURE, hf_log_probs, sharp_native_engine
from rlrun.cli.parser import parse_args
from rlrun.data.tasksets import env_args
from rlrun.environments.tasksets import build_taskset_episodes
from rlrun.models.tiny import build_byte_tokenizer
from rlrun.plan.preflight import ppo_prompts
from rlrun.runtime.errors import AgentError, ConfigError

sys.path.insert(0, str(REPO / "examples" / "tasksets"))  # as PYTHONPATH=examples/tasksets puts it for a run
TOK = build_byte_tokenizer()
ARGS = ["--env_id", "chars_taskset", "--generate_max_len", "12", "--temperature", str(SHARP_TEMPERATURE)]


def test_a_taskset_s_episodes_become_rows_of_the_engines_ids_with_the_rubric_s_reward():
    cfg = parse_args(ARGS).config
    prompts = ppo_prompts(cfg, TOK, None)
    assert len(prompts.texts) == 32 and prompts.texts[1] == "User: Write only letters (1):\nAssistant: "
    assert [r.extra_info for r in prompts.records[:3]] == [{"task": 0}, {"task": 1}, {"task": 2}]
    engine = sharp_native_engine()
    source = build_taskset_episodes(cfg.agent, cfg.generation, TOK, "tiny", None, 0, cfg.train.max_samples)
    rows = [0, 1, 2, 3, 4, 5]
    eps = source.episodes(engine, prompts, rows, [prompts.ids[i] for i in rows], seed=3)
    assert eps.stats["failed"] == 0 and eps.stats["turns"] == 6 and eps.stats["calls_off_branch"] == 0
    lengths = []
    for k, i in enumerate(rows):
        # verifiers rendered the task's chat itself: the same ids as rlrun's own prompt formatting
        assert eps.prompts[k] == prompts.ids[i]
        response, mask = eps.responses[k], eps.action_masks[k]
        assert 1 <= len(response) <= 12 and mask == [1] * len(response)
        full = hf_log_probs(engine.model, SHARP_TEMPERATURE, eps.prompts[k], response)
        torch.testing.assert_close(torch.tensor(eps.log_probs[k]), full, rtol=0, atol=2e-4)
        text = TOK.decode(response, skip_special_tokens=True)
        targets = "0123456789" if i % 2 == 0 else "abcdefghijklmnopqrstuvwxyz"
        assert eps.rewards[k].item() == pytest.approx(sum(c in targets for c in text) / max(1, len(text)), abs=1e-6)
        lengths.append(len(text))
    # the rubric's score and metric, summed over the episodes (agent/ means per episode in the step's metrics)
    assert eps.stats["reward/share"] == pytest.approx(eps.rewards.sum().item(), abs=1e-5)
    assert eps.stats["metric/length"] == pytest.approx(sum(lengths))
    source.close()


def test_a_taskset_that_does_not_load_or_bad_args_are_one_clear_error():
    with pytest.raises(ConfigError, match="--env_id no_such_taskset .* does not load as a verifiers 0.4 taskset"):
        ppo_prompts(parse_args(["--env_id", "no_such_taskset"]).config, TOK, None)
    with pytest.raises(ConfigError, match="--env_args .* is not JSON"):
        env_args("{split: test}")
    with pytest.raises(ConfigError, match="is not a JSON object"):
        env_args("[1]")
    with pytest.raises(ConfigError, match="the taskset's tasks are the prompts; drop --prompt_data"):
        from rlrun.plan.checks import check_values

        check_values(parse_args([*ARGS, "--prompt_data", "x.jsonl"]).config)


def test_an_episode_that_fails_trains_nothing_and_most_failing_is_one_line():
    """Task 2's prompt does not fit --prompt_max_len + --generate_max_len: the gateway refuses it (400), the harness
    fails, verifiers records the error; that row has no action and its group's mean reward, the others train."""
    cfg = parse_args(["--env_id", "long_prompt_taskset", "--generate_max_len", "8", "--prompt_max_len", "64",
                      "--temperature", str(SHARP_TEMPERATURE)]).config
    prompts = ppo_prompts(cfg, TOK, None)
    source = build_taskset_episodes(cfg.agent, cfg.generation, TOK, "tiny", None, 0, cfg.train.max_samples)
    engine = sharp_native_engine()
    eps = source.episodes(engine, prompts, [0, 1, 2, 3], [prompts.ids[i] for i in range(4)], seed=1)
    assert eps.stats["failed"] == 1
    assert sum(eps.action_masks[2]) == 0 and all(sum(eps.action_masks[k]) > 0 for k in (0, 1, 3))
    assert eps.rewards.tolist() == [1.0, 1.0, 0.0, 1.0]  # its own group (its prompt) has no good episode: 0
    with pytest.raises(AgentError, match=r"^3 of 4 verifiers episodes \(--env_id\) failed on this engine rank"):
        source.episodes(engine, prompts, [2, 2, 2, 0], [prompts.ids[i] for i in (2, 2, 2, 0)], seed=1)
    source.close()
