"""--dynamic_batch and its token budgets under every spelling: rlrun's, OpenRLHF's classic and 0.11 dotted flags,
verl's keys; and the start-up checks (a budget below the longest possible sequence names both numbers)."""

from __future__ import annotations

import pytest

from rlrun.cli.parser import IGNORED_FLAGS, parse_args
from rlrun.plan.checks import check_batches, check_values
from rlrun.runtime.errors import ConfigError


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    """parse_args reads the launched world size (verl's keys); a world of one here."""
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)


def _train(*argv: str):
    return parse_args(list(argv)).config.train


def test_defaults_are_openrlhfs_and_off():
    t = _train()  # rlrun.plan.speed turns it on with a CUDA device unless it is given (tests/plan/test_speed.py)
    assert (t.dynamic_batch, t.train_max_tokens_per_gpu, t.rollout_max_tokens_per_gpu) == (False, 16192, None)
    assert not {"use_dynamic_batch", "train_max_tokens_per_gpu", "rollout_max_tokens_per_gpu"} & set(IGNORED_FLAGS)


@pytest.mark.parametrize("argv", [
    ["--dynamic_batch", "--train_max_tokens_per_gpu", "4096", "--rollout_max_tokens_per_gpu", "8192"],
    ["--use_dynamic_batch", "--train_max_tokens_per_gpu", "4096", "--rollout_max_tokens_per_gpu", "8192"],
    ["--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "4096", "--rollout.max_tokens_per_gpu=8192"],
    ["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
     "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192"],
], ids=["rlrun", "openrlhf-classic", "openrlhf-0.11", "verl"])
def test_every_spelling_lands_on_the_fields(argv):
    parsed = parse_args(argv)
    t = parsed.config.train
    assert (t.dynamic_batch, t.train_max_tokens_per_gpu, t.rollout_max_tokens_per_gpu) == (True, 4096, 8192)
    assert not parsed.ignored
    assert {"dynamic_batch", "train_max_tokens_per_gpu", "rollout_max_tokens_per_gpu"} <= parsed.explicit


def test_classic_name_takes_a_value_and_later_wins():
    assert not _train("--use_dynamic_batch=false").dynamic_batch
    assert not _train("--use_dynamic_batch", "--dynamic_batch", "false").dynamic_batch
    assert _train("--dynamic_batch", "false", "--use_dynamic_batch").dynamic_batch


def test_verl_keys_rlrun_has_one_value_for_are_reported():
    parsed = parse_args(["actor_rollout_ref.actor.use_dynamic_bsz=true", "critic.use_dynamic_bsz=true",
                         "critic.ppo_max_token_len_per_gpu=9000", "critic.forward_max_token_len_per_gpu=9000",
                         "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true",
                         "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=9000"])
    assert parsed.config.train.dynamic_batch and parsed.config.train.train_max_tokens_per_gpu == 16192
    ignored = {line.split(":")[0] for line in parsed.ignored}
    assert ignored == {"critic.use_dynamic_bsz", "critic.ppo_max_token_len_per_gpu", "critic.forward_max_token_len_per_gpu",
                       "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
                       "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"}, parsed.ignored


def test_a_budget_below_the_longest_sequence_names_both_numbers():
    cfg = parse_args(["--dynamic_batch", "--prompt_max_len", "1024", "--generate_max_len", "4096",
                      "--train_max_tokens_per_gpu", "4096"]).config
    with pytest.raises(ConfigError, match=r"--train_max_tokens_per_gpu 4096 is below the longest possible sequence, "
                                          r"--prompt_max_len 1024 \+ --generate_max_len 4096 = 5120 tokens.*at least 5120"):
        check_values(cfg)
    cfg = parse_args(["--dynamic_batch", "--prompt_max_len", "64", "--generate_max_len", "16",
                      "--train_max_tokens_per_gpu", "80", "--rollout_max_tokens_per_gpu", "79"]).config
    with pytest.raises(ConfigError, match=r"--rollout_max_tokens_per_gpu 79 is below .* = 80 tokens"):
        check_values(cfg)
    # Without --dynamic_batch the budgets are not used: only their sign is checked.
    check_values(parse_args(["--train_max_tokens_per_gpu", "10"]).config)
    with pytest.raises(ConfigError, match="--train_max_tokens_per_gpu must be > 0, got 0"):
        check_values(parse_args(["--train_max_tokens_per_gpu", "0"]).config)


def test_micro_train_batch_size_need_not_divide_the_shares_with_dynamic_batch():
    argv = ["--rollout_batch_size", "8", "--n_samples_per_prompt", "2", "--train_batch_size", "8",
            "--micro_train_batch_size", "3"]
    with pytest.raises(ConfigError, match="multiple of --micro_train_batch_size 3"):
        check_batches(parse_args(argv).config, {"actor": 2})
    check_batches(parse_args([*argv, "--dynamic_batch"]).config, {"actor": 2})
    with pytest.raises(ConfigError, match=r"--train_batch_size 8 must be a multiple of the 3 actor ranks \(--dynamic_batch"):
        check_batches(parse_args([*argv, "--dynamic_batch", "--rollout_batch_size", "12"]).config, {"actor": 3})
