"""Issue 23's probes as real runs: a run never loses or silently corrupts another's checkpoints, damaged
checkpoints are caught before use and skipped for an intact one, a full disk is one line, secrets never reach
disk, a resume says what it changes (and refuses what it cannot honour), a hung reward function is named within
its bound, and an export refuses NaN weights.

Runs are the embedded tiny model on one process (`python -m rlrun.ppo`) unless the probe needs several ranks;
each run proves as much as it can. The disk-full probe mounts a small tmpfs (the real ENOSPC from the kernel);
it is skipped, saying so, where this machine may not mount one.
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from pathlib import Path

import pytest

from helpers import REPO, RunResult, run_rlrun, start_reward_server, stop_process
from rlrun.checkpoint import store as ckpt
from rlrun.checkpoint import store as manifest

SMALL = ["--config", "configs/demo.yaml", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2",
         "--train_batch_size", "8", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "2",
         "--generate_max_len", "8", "--dist_timeout", "60"]
SECRET = "k3y-" + uuid.uuid4().hex


def _run(save: Path, *args: str, nproc: int = 0, ckpt_path: Path | None = None, env: dict | None = None,
         agent: bool = False) -> RunResult:
    return run_rlrun(nproc, SMALL + ["--ckpt_path", str(ckpt_path or save / "ckpt"), *args], save, timeout=240, env=env,
                     agent=agent)


def _failed_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if ": FAILED (" in line]


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))


@pytest.fixture(scope="module")
def secret_url(tmp_path_factory):
    """A reward server whose URL carries a credential in its query string (as users paste them)."""
    where = tmp_path_factory.mktemp("reward_server")
    proc, port = start_reward_server(REPO / "src" / "rlrun" / "rewards" / "demo.py", where)
    try:
        yield f"http://127.0.0.1:{port}/reward?api_key={SECRET}"
    finally:
        stop_process(proc)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_runs_own_their_checkpoints_and_resume_says_what_changed(tmp_path, secret_url):
    """Probes 1, 5 and 6. Run A (3 steps, a checkpoint each) scores through a URL holding a key: the key is
    nowhere on disk. Run B into the same --ckpt_path without --load_checkpoint stops at start-up naming the way
    out, and A's checkpoints are all still there. With --overwrite_checkpoints it runs and A's go once it has one
    of its own. A resume with another learning rate says so and uses it; one with another seed is refused."""
    root = tmp_path / "ckpt"
    a = _run(tmp_path / "a", "--max_steps", "3", "--save_steps", "1", "--remote_rm_url", secret_url, ckpt_path=root)
    assert a.returncode == 0, a.output[-3000:]
    assert _steps(root) == ["step_00000001", "step_00000002", "step_00000003"]
    on_disk = [p for p in list(root.rglob("*")) + list((tmp_path / "a").rglob("*")) if p.is_file()]
    assert any(p.name == ckpt.COMPLETE for p in on_disk)
    leaked = [str(p) for p in on_disk if SECRET.encode() in p.read_bytes()]
    assert not leaked, leaked
    stored = json.loads((root / "step_00000003" / ckpt.COMPLETE).read_text())
    assert stored["meta"]["config"]["reward"]["remote_rm_url"].endswith("/reward?<redacted>")
    assert SECRET not in a.output

    b = _run(tmp_path / "b", "--max_steps", "1", "--save_steps", "1", ckpt_path=root)
    assert b.returncode != 0
    (line,) = _failed_lines(b.output)
    assert "in phase startup: CheckpointError: --ckpt_path" in line and "holds checkpoints of another run" in line
    assert all(way in line for way in ("--load_checkpoint", "fresh --ckpt_path", "--overwrite_checkpoints"))
    assert _steps(root) == ["step_00000001", "step_00000002", "step_00000003"] and b.metrics == []

    c = _run(tmp_path / "c", "--max_steps", "1", "--save_steps", "1", "--overwrite_checkpoints", ckpt_path=root)
    assert c.returncode == 0, c.output[-3000:]
    assert "3 checkpoint(s) of another run" in c.output
    assert _steps(root) == ["step_00000001"]
    c_run = json.loads((root / "step_00000001" / ckpt.COMPLETE).read_text())["meta"]["run"]["id"]
    assert c_run != stored["meta"]["run"]["id"]

    d = _run(tmp_path / "c", "--max_steps", "2", "--save_steps", "1", "--load_checkpoint", "--actor_learning_rate", "0.005",
             ckpt_path=root)
    assert d.returncode == 0, d.output[-3000:]
    assert ("resuming with changed settings (applied from the next step): --actor_learning_rate 0.01 -> 0.005, "
            "--max_steps 1 -> 2") in d.output
    assert d.metrics[-1]["step"] == 2 and d.metrics[-1]["actor/lr"] == pytest.approx(5e-4)  # 0.005 x the schedule's end
    # The resumed run continues run C: its checkpoints carry C's id, so C's pruning covers them.
    assert json.loads((root / "step_00000002" / ckpt.COMPLETE).read_text())["meta"]["run"]["id"] == c_run

    e = _run(tmp_path / "c", "--max_steps", "3", "--save_steps", "1", "--load_checkpoint", "--seed", "7", ckpt_path=root)
    assert e.returncode != 0
    (line,) = _failed_lines(e.output)
    assert re.search(r"cannot resume the step-2 checkpoint in \S+ with --seed \d+ -> 7: the prompt order", line), line
    assert _steps(root) == ["step_00000001", "step_00000002"]


def _reseal(step_dir: Path) -> None:
    """Rewrite a checkpoint's manifest for its current bytes: damage no checksum can see."""
    record = json.loads((step_dir / ckpt.COMPLETE).read_text())
    record["files"] = manifest.describe(str(step_dir), manifest.list_files(str(step_dir), skip=[ckpt.COMPLETE]))
    (step_dir / ckpt.COMPLETE).write_text(json.dumps(record))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_damaged_checkpoints_are_skipped_for_an_intact_one_and_nan_weights_are_not_exported(tmp_path):
    """Probes 2 and 3, on two ranks. 64 bytes overwritten inside the newest optimizer shard (its size unchanged)
    are caught by the checksum on load; the step before it is damaged so that only DCP's load can tell (its
    manifest re-sealed over a truncated .metadata): both are skipped with one line each, and the run resumes from
    the one before. Then a run whose weights blow up (learning rate 1e39) is refused its export, naming the
    tensor, unless --export_nonfinite."""
    root = tmp_path / "ckpt"
    full = _run(tmp_path, "--max_steps", "3", "--save_steps", "1", nproc=2)
    assert full.returncode == 0, full.output[-3000:]
    assert re.search(r"checkpoint saved: \S+step_00000003 \([\d.]+ MB in [\d.]+ s, checksums [\d.]+ s\)", full.output)
    shard = root / "step_00000003" / "actor" / "__1_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as fh:
        fh.seek(size // 2)
        fh.write(b"\xff" * 64)
    assert shard.stat().st_size == size
    metadata = root / "step_00000002" / "actor" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])
    _reseal(root / "step_00000002")

    resumed = _run(tmp_path, "--max_steps", "4", "--save_steps", "1", "--load_checkpoint", nproc=2)
    assert resumed.returncode == 0, resumed.output[-3000:]
    skipped = re.findall(r"warning\] skipping checkpoint (\S+): (.*)", resumed.output)
    assert [Path(p).name for p, _ in skipped] == ["step_00000003", "step_00000002"], resumed.output[-3000:]
    assert skipped[0][1].startswith("file actor/__1_0.distcp has CRC-32 ")
    assert skipped[1][1].startswith("loading it failed (rank 0: ") and ".metadata" in skipped[1][1]
    assert "(its bytes changed after the save)" in skipped[0][1]
    assert f"resumed from {root / 'step_00000001'} at step 1" in resumed.output
    assert [m["step"] for m in resumed.metrics][-3:] == [2, 3, 4]
    # The damaged checkpoints were replaced by the resumed run's own saves of the same steps.
    assert _steps(root) == ["step_00000002", "step_00000003", "step_00000004"]
    assert ckpt.find_latest(str(root))[0].step == 4

    blown = _run(tmp_path / "nan", "--max_steps", "1", "--actor_learning_rate", "1e39")
    assert blown.returncode != 0
    (line,) = _failed_lines(blown.output)
    assert re.search(r"NonFiniteWeights: not exporting to \S+: weight \S+ has \d+ NaN/inf values", line), line
    assert "--export_nonfinite" in line and not (tmp_path / "nan" / "model.safetensors").exists()
    kept = _run(tmp_path / "nan", "--max_steps", "1", "--actor_learning_rate", "1e39", "--export_nonfinite")
    assert kept.returncode == 0, kept.output[-3000:]
    assert (tmp_path / "nan" / "model.safetensors").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MB tmpfs: less than one checkpoint of the tiny model."""
    where = tmp_path / "small_disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}); the disk-full probe needs one")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_full_disk_is_one_line_and_leaves_nothing_behind(tmp_path, small_disk):
    """Probe 4, on two ranks: every rank says the same one line (path, the system's reason, the space needed and
    free), no DCP traceback, no temporary directory left."""
    root = small_disk / "ckpt"
    run = _run(tmp_path, "--max_steps", "2", "--save_steps", "1", nproc=2, ckpt_path=root, agent=True)
    assert run.returncode != 0
    lines = _failed_lines(run.output)
    assert len(lines) == 2, run.output[-3000:]
    for line in lines:
        assert re.search(rf"in phase save at step \d: StorageError: cannot write checkpoint step 1 to {root}/"
                         r"\.tmp_step_00000001: No space left on device \(errno 28[^)]*\); it needs about [\d.]+ MB, "
                         r"[\d.]+ MB free there; free space there, or point --ckpt_path", line), line
    assert run.output.count("Traceback") == 1  # torchrun's own report of the failed workers, nothing from rlrun
    assert [p.name for p in root.iterdir()] == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hung_reward_function_is_named_within_its_bound(tmp_path):
    """Probe 7, on two ranks: rank 1's reward function never returns; --reward_timeout 3 ends the run with one
    FAILED line from rank 1 naming the function and the batch (rank 0 notes the broken collective), long
    before --dist_timeout (60) or the watchdog."""
    reward = REPO / "tests" / "fixtures" / "reward_sleep_forever.py"
    run = _run(tmp_path, "--max_steps", "2", "--remote_rm_url", str(reward), "--reward_timeout", "3", nproc=2)
    assert run.returncode != 0
    (named,) = _failed_lines(run.output)
    assert named.startswith("[rlrun") and "rank 1: FAILED (actor,engine) in phase generate at step 1: RewardError: " \
        f"reward function {reward} did not return within --reward_timeout 3 s on a batch of " in named, run.output[-3000:]
    assert "most recent call first" not in run.output  # no watchdog stack dump: the bound came first
    assert run.metrics == []
