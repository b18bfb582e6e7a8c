"""Checkpoint directories on disk (rlrun.checkpoint.store): atomic publication, validation, discovery, retention.

No processes and no models: a "checkpoint" here is a directory of small files written the way the
ranks write theirs (into the temporary directory that prepare() returns), then sealed by publish().
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import pytest

from rlrun.checkpoint import store as ckpt
from rlrun.checkpoint.store import COMPLETE, LATEST, CheckpointError


def _write_parts(path: str, step: int) -> None:
    """What the ranks write before the checkpoint is sealed (sharded actor state + trainer state)."""
    os.makedirs(os.path.join(path, "actor"), exist_ok=True)
    for rank in range(2):
        Path(path, "actor", f"__{rank}_0.distcp").write_bytes(bytes([step, rank]) * 100)
    Path(path, "actor", ".metadata").write_bytes(b"metadata" * 10)
    Path(path, "trainer_state.json").write_text(json.dumps({"step": step}))


def _save(root: Path, step: int, keep: int = 3) -> str:
    tmp = ckpt.prepare(str(root), step)
    _write_parts(tmp, step)
    return ckpt.publish(str(root), step, {"step": step, "actor": {"digest": "d"}}, keep)


def _steps_on_disk(root: Path) -> list[str]:
    return sorted(name for name in os.listdir(root) if name != LATEST)


def _latest(root: Path):
    found, warnings = ckpt.find_latest(str(root))
    return (None if found is None else found.step), warnings


# ---- publish -------------------------------------------------------------------------------------


def test_publish_creates_step_dir_manifest_and_latest_pointer(tmp_path):
    root = tmp_path / "ckpt"
    final = _save(root, 2)
    assert final == ckpt.step_dir(str(root), 2) == str(root / "step_00000002")
    assert _steps_on_disk(root) == ["step_00000002"]  # the temporary directory was renamed away
    record = ckpt.validate(final)
    assert record["step"] == 2 and record["meta"]["step"] == 2
    assert set(record["files"]) == {"actor/__0_0.distcp", "actor/__1_0.distcp", "actor/.metadata", "trainer_state.json"}
    data = (root / "step_00000002" / "actor" / "__0_0.distcp").read_bytes()
    assert record["files"]["actor/__0_0.distcp"] == {"bytes": 200, "crc32": f"{zlib.crc32(data):08x}"}
    assert json.loads((root / LATEST).read_text()) == {"step": 2, "path": "step_00000002"}
    # No stray temporary files from the atomic JSON writes.
    assert not [p for p in root.rglob("*.tmp")]

    _save(root, 4)
    assert json.loads((root / LATEST).read_text()) == {"step": 4, "path": "step_00000004"}
    assert _latest(root) == (4, [])


def test_prepare_empties_a_previous_attempts_leftovers(tmp_path):
    root = tmp_path / "ckpt"
    tmp = ckpt.prepare(str(root), 3)
    _write_parts(tmp, 3)
    Path(tmp, "stale_from_a_killed_attempt").write_text("x")
    assert ckpt.prepare(str(root), 3) == tmp
    assert os.listdir(tmp) == []


def test_publish_the_same_step_again_replaces_it(tmp_path):
    """After an elastic restart the same step can be saved twice: the newer one wins, whole."""
    root = tmp_path / "ckpt"
    _save(root, 2)
    Path(root, "step_00000002", "only_in_the_first_save").write_text("x")
    tmp = ckpt.prepare(str(root), 2)
    _write_parts(tmp, 2)
    ckpt.publish(str(root), 2, {"step": 2, "second": True}, 3)
    assert not (root / "step_00000002" / "only_in_the_first_save").exists()
    assert ckpt.validate(str(root / "step_00000002"))["meta"]["second"] is True


# ---- find_latest / validate ----------------------------------------------------------------------


def test_find_latest_on_missing_or_empty_root(tmp_path):
    assert ckpt.find_latest(str(tmp_path / "nope")) == (None, [])
    (tmp_path / "empty").mkdir()
    assert ckpt.find_latest(str(tmp_path / "empty")) == (None, [])


def test_find_latest_picks_the_newest_valid_numerically(tmp_path):
    root = tmp_path / "ckpt"
    for step in (2, 9, 10):
        _save(root, step, keep=0)
    os.rename(root / "step_00000009", root / "step_9")  # sorts after step_00000010 as text, not as a number
    found, warnings = ckpt.find_latest(str(root))
    assert (found.step, found.path, warnings) == (10, str(root / "step_00000010"), [])
    assert found.meta == {"step": 10, "actor": {"digest": "d"}}


def _break_no_manifest(d: Path) -> None:
    (d / COMPLETE).unlink()


def _break_truncated_shard(d: Path) -> None:
    shard = d / "actor" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:17])


def _break_missing_shard(d: Path) -> None:
    (d / "actor" / "__0_0.distcp").unlink()


def _break_empty_shard(d: Path) -> None:
    (d / "actor" / ".metadata").write_bytes(b"")


def _break_garbage_json(d: Path) -> None:
    (d / COMPLETE).write_text('{"format": 2, "step": 4, "files": {"actor/.meta')


def _break_binary_json(d: Path) -> None:
    (d / COMPLETE).write_bytes(b"\xff\xfe\x00garbage")


def _break_json_not_a_manifest(d: Path) -> None:
    (d / COMPLETE).write_text("null")


def _break_json_without_files(d: Path) -> None:
    (d / COMPLETE).write_text(json.dumps({"format": 2, "step": 4, "meta": {}}))


def _break_future_format(d: Path) -> None:
    record = json.loads((d / COMPLETE).read_text())
    (d / COMPLETE).write_text(json.dumps(dict(record, format=99)))


BREAKS = {
    "no_manifest": (_break_no_manifest, "no COMPLETE.json"),
    "truncated_shard": (_break_truncated_shard, "actor/__1_0.distcp has 17 bytes, expected 200"),
    "missing_shard": (_break_missing_shard, "actor/__0_0.distcp is missing"),
    "empty_metadata": (_break_empty_shard, "actor/.metadata has 0 bytes"),
    "garbage_json": (_break_garbage_json, "unreadable COMPLETE.json"),
    "binary_json": (_break_binary_json, "unreadable COMPLETE.json"),
    "json_not_a_manifest": (_break_json_not_a_manifest, "not a checkpoint manifest"),
    "json_without_files": (_break_json_without_files, "not a checkpoint manifest"),
    "future_format": (_break_future_format, "format 99"),
}


@pytest.mark.parametrize("kind", list(BREAKS))
def test_invalid_newest_checkpoint_is_skipped_with_a_warning(tmp_path, kind):
    root = tmp_path / "ckpt"
    _save(root, 2)
    _save(root, 4)
    newest = root / "step_00000004"
    breaker, reason = BREAKS[kind]
    breaker(newest)

    with pytest.raises(CheckpointError, match="step_00000004") as err:
        ckpt.validate(str(newest))
    assert reason in str(err.value)

    found, warnings = ckpt.find_latest(str(root))
    assert found.step == 2 and found.path == str(root / "step_00000002")
    assert len(warnings) == 1 and "skipping checkpoint" in warnings[0]
    assert "step_00000004" in warnings[0] and reason in warnings[0]


def test_all_invalid_means_none_with_a_warning_each(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 2)
    _save(root, 4)
    _break_missing_shard(root / "step_00000002")
    _break_no_manifest(root / "step_00000004")
    found, warnings = ckpt.find_latest(str(root))
    assert found is None
    assert len(warnings) == 2
    assert "step_00000004" in warnings[0] and "step_00000002" in warnings[1]


def test_leftover_tmp_dir_is_never_returned_and_warned_about(tmp_path):
    """Even a fully written and sealed temporary directory (killed between seal and rename) is not used."""
    root = tmp_path / "ckpt"
    _save(root, 2)
    tmp = ckpt.prepare(str(root), 4)
    _write_parts(tmp, 4)
    ckpt.write_json_atomic(os.path.join(tmp, COMPLETE), {"format": 1, "step": 4, "meta": {}, "files": {}})
    found, warnings = ckpt.find_latest(str(root))
    assert found.step == 2
    assert len(warnings) == 1 and ".tmp_step_00000004" in warnings[0] and "did not finish" in warnings[0]


def test_step_dir_without_any_valid_predecessor_and_odd_names_ignored(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 2)
    (root / "step_abc").mkdir()  # not a step directory
    (root / "notes.txt").write_text("x")
    (root / "step_00000007").write_text("a file, not a directory")
    found, warnings = ckpt.find_latest(str(root))
    assert found.step == 2
    assert len(warnings) == 1 and "step_00000007" in warnings[0]


# ---- crash simulation ----------------------------------------------------------------------------


def test_crash_between_writing_shards_and_publish_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 2)
    tmp = ckpt.prepare(str(root), 4)
    _write_parts(tmp, 4)  # every rank wrote its part ... and then the process died: no publish
    found, warnings = ckpt.find_latest(str(root))
    assert found.step == 2
    assert json.loads((root / LATEST).read_text())["step"] == 2
    assert any(".tmp_step_00000004" in w for w in warnings)

    # The restarted run saves step 4 again: the leftover is replaced and the new checkpoint wins.
    _save(root, 4)
    assert _steps_on_disk(root) == ["step_00000002", "step_00000004"]
    assert _latest(root) == (4, [])


def test_crash_half_way_through_the_shards(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 2)
    tmp = ckpt.prepare(str(root), 4)
    os.makedirs(os.path.join(tmp, "actor"))
    Path(tmp, "actor", "__0_0.distcp").write_bytes(b"partial")
    assert _latest(root)[0] == 2


# ---- prune ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_prune_keeps_the_newest_k(tmp_path, keep):
    root = tmp_path / "ckpt"
    for step in range(1, 6):
        _save(root, step, keep=keep)
        expected = [f"step_{s:08d}" for s in range(max(1, step - keep + 1), step + 1)]
        assert _steps_on_disk(root) == expected
        assert _latest(root) == (step, [])


def test_prune_keep_zero_or_negative_keeps_everything(tmp_path):
    root = tmp_path / "ckpt"
    for step in range(1, 4):
        _save(root, step, keep=0)
    _save(root, 4, keep=-1)
    assert len(_steps_on_disk(root)) == 4


def test_an_unfinished_save_never_costs_the_previous_checkpoint(tmp_path):
    """keep=1: the old checkpoint is deleted only once a newer complete one exists."""
    root = tmp_path / "ckpt"
    _save(root, 2, keep=1)
    tmp = ckpt.prepare(str(root), 4)
    _write_parts(tmp, 4)
    ckpt.prune(str(root), 1, None)  # an incomplete newer directory does not count ...
    assert (root / "step_00000002").is_dir()
    assert _latest(root)[0] == 2  # ... and is removed as stale
    assert not os.path.exists(tmp)

    _save(root, 4, keep=1)
    assert _steps_on_disk(root) == ["step_00000004"]


def test_prune_does_not_count_a_step_dir_without_manifest(tmp_path):
    root = tmp_path / "ckpt"
    _save(root, 2, keep=1)
    (root / "step_00000003").mkdir()  # e.g. copied in by hand, unsealed
    ckpt.prune(str(root), 1, None)
    assert (root / "step_00000002").is_dir()


def test_publish_never_prunes_newer_checkpoints(tmp_path):
    """A run resumed from step 2 past a corrupt step 6 must not delete it (nor the unreadable step 4): pruning only
    removes this run's checkpoints older than the ones it keeps. The new step 3 is the resume point after it."""
    root = tmp_path / "ckpt"
    for step in (2, 4, 6):
        _save(root, step, keep=3)
    _break_truncated_shard(root / "step_00000006")
    _break_no_manifest(root / "step_00000004")
    assert _latest(root)[0] == 2  # the resume point
    _save(root, 3, keep=1)
    assert _steps_on_disk(root) == ["step_00000003", "step_00000004", "step_00000006"]
    found, _ = ckpt.find_latest(str(root), exclude=[str(root / "step_00000006")])
    assert found.step == 3


def _save_as(root: Path, step: int, run: str | None, keep: int = 3, remove_foreign: bool = False) -> str:
    tmp = ckpt.prepare(str(root), step)
    _write_parts(tmp, step)
    meta = {"step": step} | ({"run": {"id": run, "config_digest": "c"}} if run else {})
    return ckpt.publish(str(root), step, meta, keep, remove_foreign=remove_foreign)


def test_prune_keeps_other_runs_checkpoints_unless_told(tmp_path):
    """Issue 23's first probe, at the file level: run A saved steps 1-3; run B (told to share the directory)
    saves step 1 with keep 1: A's checkpoints stay. With remove_foreign (--overwrite_checkpoints) they go."""
    root = tmp_path / "ckpt"
    for step in (1, 2, 3):
        _save_as(root, step, "run-a")
    _save_as(root, 1, "run-b", keep=1)  # the same step number: run B's replaces it, A's 2 and 3 stay
    assert _steps_on_disk(root) == ["step_00000001", "step_00000002", "step_00000003"]
    _save_as(root, 2, "run-b", keep=1)
    assert _steps_on_disk(root) == ["step_00000002", "step_00000003"]  # B's 2 replaced A's, B's 1 pruned, A's 3 kept
    assert ckpt.find_latest(str(root))[0].run == "run-a"
    _save_as(root, 3, "run-b", keep=1, remove_foreign=True)
    assert _steps_on_disk(root) == ["step_00000003"]
    assert ckpt.find_latest(str(root))[0].run == "run-b"


def test_format_1_manifests_still_load(tmp_path):
    """Checkpoints sealed before checksums (sizes only) validate by size."""
    root = tmp_path / "ckpt"
    final = Path(_save(root, 2))
    record = json.loads((final / COMPLETE).read_text())
    record["format"] = 1
    record["files"] = {rel: entry["bytes"] for rel, entry in record["files"].items()}
    (final / COMPLETE).write_text(json.dumps(record))
    assert ckpt.find_latest(str(root))[0].step == 2
    _break_truncated_shard(final)
    with pytest.raises(CheckpointError, match="has 17 bytes, expected 200"):
        ckpt.validate(str(final))


# ---- errors --------------------------------------------------------------------------------------


def test_unwritable_ckpt_path_names_the_path(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    root = blocker / "checkpoints"
    with pytest.raises(CheckpointError) as err:
        ckpt.prepare(str(root), 1)
    assert str(root) in str(err.value) and "--ckpt_path" in str(err.value)


def test_ckpt_path_that_is_a_file_names_the_path(tmp_path):
    root = tmp_path / "ckpt"
    root.write_text("not a directory")
    with pytest.raises(CheckpointError, match=str(root)):
        ckpt.prepare(str(root), 1)
    assert ckpt.find_latest(str(root)) == (None, [])


def test_write_json_atomic_leaves_old_content_on_failure(tmp_path):
    target = tmp_path / "state.json"
    ckpt.write_json_atomic(str(target), {"a": 1})
    with pytest.raises(TypeError):
        ckpt.write_json_atomic(str(target), {"a": object()})
    assert json.loads(target.read_text()) == {"a": 1}
