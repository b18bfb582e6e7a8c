"""Which run a checkpoint directory belongs to (rlrun.checkpoint.resume), on real directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlrun.checkpoint import store as ckpt
from rlrun.checkpoint.resume import (
    can_create,
    check_ownership,
    config_digest,
    is_restart,
    preemption_dir,
    run_identity,
    run_record,
)
from rlrun.checkpoint.store import CheckpointError


def _seal(root: Path, step: int, run: str | None) -> None:
    tmp = ckpt.prepare(str(root), step)
    Path(tmp, "state.json").write_text("{}")
    ckpt.publish(str(root), step, {"step": step} | ({"run": {"id": run}} if run else {}), 0)


def test_run_identity_follows_the_launcher():
    assert run_identity({"TORCHELASTIC_RUN_ID": "abc"}) == "torchrun-abc"
    # torchrun's default rendezvous id is "none" for every job: not an identity.
    assert run_identity({"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "77"}) == "slurm-77"
    a, b = run_identity({}), run_identity({})
    assert a.startswith("run-") and a != b
    assert is_restart({"TORCHELASTIC_RESTART_COUNT": "1"}) and not is_restart({"TORCHELASTIC_RESTART_COUNT": "0"})
    assert not is_restart({})


def test_config_digest_is_stable_and_sensitive():
    one = {"train": {"seed": 1, "lr": 1e-6}}
    assert config_digest(one) == config_digest({"train": {"lr": 1e-6, "seed": 1}})
    assert config_digest(one) != config_digest({"train": {"seed": 2, "lr": 1e-6}})
    assert run_record("r", one) == {"id": "r", "config_digest": config_digest(one)}


def test_a_new_run_into_another_runs_directory_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    assert check_ownership(str(root), "run-b", loads=False, overwrites=False, restarted=False) is None  # none yet
    for step in (1, 2, 3):
        _seal(root, step, "run-a")
    with pytest.raises(CheckpointError) as err:
        check_ownership(str(root), "run-b", loads=False, overwrites=False, restarted=False)
    message = str(err.value)
    assert str(root) in message and "step_00000003, step_00000002, step_00000001" in message
    assert "newest step 3, written by run-a" in message
    for way_out in ("--load_checkpoint", "fresh --ckpt_path", "--overwrite_checkpoints"):
        assert way_out in message
    assert "\n" not in message
    # Continuing is no conflict; replacing is allowed and said.
    assert check_ownership(str(root), "run-b", loads=True, overwrites=False, restarted=False) is None
    said = check_ownership(str(root), "run-b", loads=False, overwrites=True, restarted=False)
    assert said and "3 checkpoint(s) of another run" in said and "deleted when this run saves its first" in said
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000002", "step_00000003"]


def test_launchers_reuse_ids_so_only_a_restart_owns_what_its_id_wrote(tmp_path):
    """RunPod's default rendezvous id is the same for every launch: a fresh launch with it is still a new run.
    A restarted worker group (TORCHELASTIC_RESTART_COUNT > 0) owns its earlier attempt's checkpoints."""
    root = tmp_path / "ckpt"
    _seal(root, 1, "torchrun-rlrun")
    with pytest.raises(CheckpointError, match="another run"):
        check_ownership(str(root), "torchrun-rlrun", loads=False, overwrites=False, restarted=False)
    assert check_ownership(str(root), "torchrun-rlrun", loads=False, overwrites=False, restarted=True) is None
    _seal(root, 2, "torchrun-other")
    with pytest.raises(CheckpointError, match="step_00000002; newest step 2, written by torchrun-other"):
        check_ownership(str(root), "torchrun-rlrun", loads=False, overwrites=False, restarted=True)


def test_unsealed_and_legacy_directories(tmp_path):
    root = tmp_path / "ckpt"
    ckpt.prepare(str(root), 5)  # an unfinished save is nobody's checkpoint
    (root / "step_00000009").mkdir()  # nor is a step directory without a manifest
    assert check_ownership(str(root), "run-b", loads=False, overwrites=False, restarted=False) is None
    _seal(root, 1, None)  # sealed before runs were recorded: still another run's
    with pytest.raises(CheckpointError, match="written by an earlier rlrun"):
        check_ownership(str(root), "run-b", loads=False, overwrites=False, restarted=True)


def test_a_run_without_periodic_checkpoints_saves_a_preemption_in_a_directory_named_by_its_run(tmp_path):
    root = tmp_path / "ckpt"
    slurm = run_identity({"TORCHELASTIC_RUN_ID": "rlrun-4242", "SLURM_JOB_ID": "4242"})
    assert preemption_dir(str(root), slurm) == str(root / "preempted-torchrun-rlrun-4242")
    # creatable without creating anything: the nearest existing ancestor is a writable directory
    assert can_create(preemption_dir(str(root), slurm)) and not root.exists()
    (tmp_path / "file").write_text("")
    assert not can_create(str(tmp_path / "file" / "preempted-x"))  # below a file
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    assert can_create(str(locked)) and (os.geteuid() == 0 or not can_create(str(locked / "ckpt" / "preempted-x")))
