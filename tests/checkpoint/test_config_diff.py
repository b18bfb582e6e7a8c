"""What a resume may change (rlrun.checkpoint.resume), on the real redacted config of the PPO trainer."""

from __future__ import annotations

import pytest

from rlrun.checkpoint.resume import check_resume, resume_changes
from rlrun.cli.parser import parse_args
from rlrun.config.fields import redacted
from rlrun.rl.assembly import FIXED_ON_RESUME


def _config(*argv: str) -> dict:
    return redacted(parse_args(list(argv)).config)


def _check(meta: dict, current: dict) -> tuple[str | None, list[str]]:
    said: list[str] = []
    return check_resume(meta, current, FIXED_ON_RESUME, "/ck", said.append), said


def test_unchanged_config_says_nothing():
    stored = _config("--seed", "3")
    assert _check({"config": stored, "step": 4}, _config("--seed", "3")) == (None, [])
    # Tuples come back from JSON as lists: the same value, not a change.
    assert resume_changes(stored, _config("--seed", "3", "--adam_betas", "0.9", "0.95"), FIXED_ON_RESUME).applied == []


def test_changes_that_can_apply_are_listed():
    stored = _config("--actor_learning_rate", "1e-6", "--max_steps", "3")
    refused, said = _check({"config": stored, "step": 3}, _config("--actor_learning_rate", "5e-7", "--max_steps", "5",
                                                                "--load_checkpoint", "--logging_steps", "2"))
    assert refused is None
    assert said == ["resuming with changed settings (applied from the next step): --actor_learning_rate 1e-06 -> "
                    "5e-07, --logging_steps 1 -> 2, --max_steps 3 -> 5"]


@pytest.mark.parametrize("flags, named", [
    (["--seed", "7"], "--seed 42 -> 7"),
    (["--rollout_batch_size", "16"], "--rollout_batch_size 8 -> 16"),
    (["--advantage_estimator", "gae"], "--advantage_estimator 'group_norm' -> 'gae'"),
    (["--pretrain", "/models/other"], "--pretrain unset -> '/models/other'"),
])
def test_changes_that_cannot_apply_are_one_error(flags, named):
    base = ["--advantage_estimator", "group_norm", "--rollout_batch_size", "8", "--seed", "42"]
    stored = _config(*base)
    current = _config(*base, *flags)
    message, said = _check({"config": stored, "step": 6}, current)
    assert said == [] and message is not None
    assert message.startswith(f"cannot resume the step-6 checkpoint in /ck with {named}: ")
    assert "fresh --ckpt_path" in message and "\n" not in message


def test_several_refused_changes_are_all_named():
    stored = _config("--seed", "1", "--rollout_batch_size", "8")
    message, _ = _check({"config": stored, "step": 1}, _config("--seed", "2", "--rollout_batch_size", "4"))
    assert "--rollout_batch_size 8 -> 4 (and 1 more: --seed 1 -> 2)" in message


def test_secrets_never_reach_the_message():
    stored = _config("--remote_rm_url", "http://rm:5000/score?api_key=old-secret-key")
    refused, said = _check({"config": stored, "step": 1},
                           _config("--remote_rm_url", "http://rm2:5000/score?api_key=new-secret-key"))
    assert refused is None and len(said) == 1 and "rm2:5000" in said[0] and "secret" not in said[0]


def test_checkpoints_without_a_stored_config_are_not_compared():
    assert _check({"step": 1}, _config("--seed", "9")) == (None, [])
