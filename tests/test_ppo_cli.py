"""The entry point with real processes: `python -m rlrun.ppo` and `torchrun -m rlrun.ppo` dry runs and errors.

A dry run validates and prints the layout without creating a process group, so even 4 torchrun ranks finish in
seconds; a config/layout error exits with one message from rank 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH_VARS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|MASTER_PORT|"
                         r"TORCHELASTIC_.*|SLURM_.*)$")
ERROR_LINE = re.compile(r"^\[rlrun [\d:]+ error\] (.*)$", re.M)
WARNING_LINE = re.compile(r"^\[rlrun [\d:]+ warning\] (.*)$", re.M)

pytestmark = pytest.mark.timeout(120)


def clean_env(**extra: str) -> dict[str, str]:
    """The test runner's environment without any launcher variables, so a plain run is a world of one."""
    env = {k: v for k, v in os.environ.items() if not LAUNCH_VARS.match(k)}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", RLRUN_NO_PROGRESS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_ppo(args: list[str], nproc: int = 0, env: dict[str, str] | None = None, timeout: float = 100):
    """(returncode, stdout + stderr, seconds) of `python -m rlrun.ppo ARGS` or `torchrun --standalone ...`."""
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "rlrun.ppo", *args]
    else:
        cmd = [sys.executable, "-m", "rlrun.ppo", *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=env or clean_env(), capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def layout_rows(output: str) -> dict[int, tuple[set[str], set[str]]]:
    """rank -> (roles, groups) from the dry-run table; asserts the table is printed exactly once."""
    headers = [m.start() for m in re.finditer(r"^rank\s*\|\s*node\s*\|\s*local\s*\|\s*roles\s*\|\s*groups", output, re.M)]
    assert len(headers) == 1, output
    rows = {}
    for line in output[headers[0]:].splitlines()[2:]:
        cells = [c.strip() for c in line.split("|")]
        if len(cells) != 5 or not cells[0].isdigit():
            break
        rows[int(cells[0])] = (set(cells[3].split(",")), set(cells[4].split(",")))
    return rows


def assert_no_rlrun_traceback(output: str) -> None:
    # torchrun prints its own ChildFailedError traceback; no rlrun frame may appear.
    assert not re.search(r'File ".*[/\\]rlrun[/\\]', output), output


# (a) -------------------------------------------------------------------------------------------------------------

def test_dry_run_single_process_defaults():
    rc, out, _ = run_ppo(["--dry_run"])
    assert rc == 0, out
    assert "layout: 1 rank (1 per node, launcher single)" in out
    rows = layout_rows(out)
    assert list(rows) == [0]
    # Defaults: GAE needs a critic, init_kl_coef 0.01 needs the reference; the engine shares the actor's rank.
    assert rows[0][0] == {"actor", "critic", "ref", "engine"}
    assert "reward" not in rows[0][0]
    assert {"world", "actor", "critic", "ref", "engine", "engine.0"} <= rows[0][1]
    assert not ERROR_LINE.search(out)


def test_dry_run_group_estimator_without_kl_has_no_critic_or_ref():
    rc, out, _ = run_ppo(["--dry_run", "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2",
                          "--init_kl_coef", "0"])
    assert rc == 0, out
    assert layout_rows(out)[0][0] == {"actor", "engine"}


def test_dry_run_creates_no_process_group(monkeypatch, capsys):
    """In-process rank 0 of a world of 4 with no other ranks: any process group or store would fail or hang."""
    dist = pytest.importorskip("torch.distributed")
    import rlrun.ppo

    def forbidden(*args, **kwargs):
        raise AssertionError("a dry run must not create a process group")

    for name in ("init_process_group", "new_group", "new_subgroups", "TCPStore"):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, forbidden)
    for key in list(os.environ):
        if LAUNCH_VARS.match(key):
            monkeypatch.delenv(key)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens there
    rc = rlrun.ppo.main(["--dry_run", "--actor_num_gpus_per_node", "2", "--ref_num_gpus_per_node", "1",
                         "--vllm_num_engines", "1", "--advantage_estimator", "group_norm",
                         "--n_samples_per_prompt", "4"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    rows = layout_rows(captured.out)
    assert [rows[r][0] for r in range(4)] == [{"actor"}, {"actor"}, {"ref"}, {"engine"}]
    assert not dist.is_initialized()


# (b) -------------------------------------------------------------------------------------------------------------

def test_torchrun_dry_run_disaggregated_layout():
    rc, out, seconds = run_ppo(["--dry_run", "--actor_num_gpus_per_node", "2", "--ref_num_gpus_per_node", "1",
                                "--vllm_num_engines", "1", "--advantage_estimator", "group_norm",
                                "--n_samples_per_prompt", "4", "--deepcompile"], nproc=4)
    assert rc == 0, out
    assert "layout: 4 ranks (4 per node, launcher torchrun)" in out
    rows = layout_rows(out)  # printed by rank 0 only
    assert sorted(rows) == [0, 1, 2, 3]
    assert rows[0][0] == {"actor"} and rows[1][0] == {"actor"}
    assert rows[2][0] == {"ref"}
    assert rows[3][0] == {"engine"}
    assert not any("critic" in roles for roles, _ in rows.values())
    # The engine is disjoint from the actor: weights go over the sync group (actor rank 0 + the engine).
    assert "sync" in rows[0][1] and "sync" in rows[3][1] and "sync" not in rows[1][1]
    # An ignored OpenRLHF flag is reported once, not once per rank.
    warnings = [w for w in WARNING_LINE.findall(out) if w.startswith("--deepcompile")]
    assert len(warnings) == 1, out
    assert seconds < 60


# (c) -------------------------------------------------------------------------------------------------------------

def test_torchrun_impossible_layout_fails_once_and_fast():
    rc, out, seconds = run_ppo(["--dry_run", "--actor_num_gpus_per_node", "3", "--ref_num_gpus_per_node", "3"],
                               nproc=4, timeout=60)
    assert rc != 0, out
    assert seconds < 30, f"took {seconds:.1f}s:\n{out}"
    errors = ERROR_LINE.findall(out)
    assert len(errors) == 1, out
    message = errors[0]
    assert "world size 4" in message
    assert "actor 3" in message and "ref 3" in message
    assert out.count(message) == 1
    # Every rank exits with the config error code (torchrun reports the children's exit codes).
    assert re.search(r"exitcode\s*:\s*2", out), out
    assert_no_rlrun_traceback(out)
    assert "rank | node" not in out


def test_invalid_value_exits_2_with_one_message():
    rc, out, _ = run_ppo(["--dry_run", "--eps_clip", "0"])
    assert rc == 2, out
    errors = ERROR_LINE.findall(out)
    assert len(errors) == 1 and "--eps_clip" in errors[0], out
    assert_no_rlrun_traceback(out)


def test_bad_launcher_env_exits_2_without_traceback():
    env = clean_env(SLURM_PROCID="0", SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS="four")
    rc, out, _ = run_ppo(["--dry_run"], env=env)
    assert rc == 2, out
    assert "SLURM_STEP_NUM_TASKS" in out and "'four'" in out
    assert_no_rlrun_traceback(out)


# (d) -------------------------------------------------------------------------------------------------------------

def test_dry_run_missing_paths_are_warnings(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    data = tmp_path / "prompts.jsonl"
    rc, out, _ = run_ppo(["--dry_run", "--pretrain", str(missing), "--prompt_data", str(data),
                          "--remote_rm_url", "http://rm.example:5000/get_reward"])
    assert rc == 0, out
    warnings = WARNING_LINE.findall(out)
    pretrain = [w for w in warnings if w.startswith(f"--pretrain {missing}")]
    assert len(pretrain) == 1, out
    assert any(w.startswith(f"--prompt_data {data}") for w in warnings), out
    assert not ERROR_LINE.search(out)
    assert layout_rows(out)


# (e) -------------------------------------------------------------------------------------------------------------

def test_unknown_flag_exits_2_with_suggestion():
    rc, out, _ = run_ppo(["--dry_run", "--rollout_batchsize", "4"])
    assert rc == 2, out
    errors = ERROR_LINE.findall(out)
    assert len(errors) == 1, out
    assert "--rollout_batchsize" in errors[0] and "did you mean '--rollout_batch_size'?" in errors[0]
    assert out.count("did you mean") == 1
    assert_no_rlrun_traceback(out)


def test_torchrun_unknown_flag_suggestion_printed_once():
    rc, out, _ = run_ppo(["--dry_run", "--actor_learning_rat", "1e-6"], nproc=2)
    assert rc != 0, out
    assert out.count("did you mean '--actor_learning_rate'?") == 1, out
    assert re.search(r"exitcode\s*:\s*2", out), out
    assert_no_rlrun_traceback(out)
