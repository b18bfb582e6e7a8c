"""--strategy deepspeed is refused in planning (before any process group or model) when DeepSpeed is missing or
outside the tested range; --strategy fsdp never looks. Needs no DeepSpeed install."""

from __future__ import annotations

import pytest

from rlrun.config.tree import Config
from rlrun.plan.plan import lay_out
from rlrun.runtime.errors import ConfigError
from rlrun.plan import checks


def _cfg(strategy: str) -> Config:
    cfg = Config()
    cfg.train.strategy = strategy  # type: ignore[assignment]
    cfg.train.rollout_batch_size = cfg.train.train_batch_size = 8
    cfg.train.micro_train_batch_size = cfg.train.micro_rollout_batch_size = 1
    return cfg


def test_missing_deepspeed_is_a_config_error_naming_the_install(monkeypatch):
    monkeypatch.setattr(checks.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"--strategy deepspeed needs DeepSpeed: pip install 'rlrun\[deepspeed\]'"):
        lay_out(_cfg("deepspeed"), world_size=2, ranks_per_node=2)
    lay_out(_cfg("fsdp"), world_size=2, ranks_per_node=2)  # FSDP2 does not need it


@pytest.mark.parametrize("found", ["0.18.9", "0.20.0", "0.19.7"])
def test_deepspeed_outside_the_tested_range_is_refused(monkeypatch, found):
    monkeypatch.setattr(checks.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(checks, "version", lambda name: found)
    with pytest.raises(ConfigError, match=rf"tested with deepspeed>=0.19.8,<0.20, found {found}"):
        lay_out(_cfg("deepspeed"), world_size=2, ranks_per_node=2)


def test_tested_versions_pass(monkeypatch):
    monkeypatch.setattr(checks.importlib.util, "find_spec", lambda name: object())
    for found in ("0.19.8", "0.19.12", "0.19.9+cu124"):
        monkeypatch.setattr(checks, "version", lambda name, v=found: v)
        lay_out(_cfg("deepspeed"), world_size=2, ranks_per_node=2)


def test_rank_lists_in_messages():
    assert checks._ranks((2, 3)) == "ranks 2-3"
    assert checks._ranks((0,)) == "rank 0"
    assert checks._ranks((0, 2)) == "ranks 0, 2"


def test_zero0_bf16_checkpoints_refused(monkeypatch):
    monkeypatch.setattr(checks.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(checks, "version", lambda name: "0.19.8")
    cfg = _cfg("deepspeed")
    cfg.train.zero_stage, cfg.model.bf16, cfg.checkpoint.save_steps = 0, True, 5
    with pytest.raises(ConfigError, match="--zero_stage 0 --bf16 cannot save or load checkpoints yet"):
        lay_out(cfg, world_size=2, ranks_per_node=2)
    cfg.checkpoint.save_steps = -1
    lay_out(cfg, world_size=2, ranks_per_node=2)
