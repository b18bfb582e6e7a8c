"""Checkpoints with real processes: exact resume, elastic restarts after a SIGKILL, resizing the
world, corrupt and incompatible checkpoints (torchrun + gloo on the embedded tiny model).

One uninterrupted reference run (2 ranks, GAE: actor + critic + reference, 4 steps, a checkpoint
every 2) is shared by the module; every interrupted or resumed run is compared with it. Batches
are shrunk so that a run is mostly process start-up.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from helpers import read_metrics, run_module_world, subprocess_env, untimed
from rlrun.checkpoint import store as ckpt
from rlrun.run.preemption import MARKER_ENV

N = 2  # save every N steps; the reference runs 2N
STEPS = 2 * N
SMALL = ["--config", "configs/demo.yaml", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2",
         "--train_batch_size", "8", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "2",
         "--generate_max_len", "8", "--dist_timeout", "30"]
GAE = ["--advantage_estimator", "gae", "--init_kl_coef", "0.01", "--save_value_network"]


@dataclass
class Run:
    returncode: int
    output: str
    metrics: list[dict]
    wall_s: float
    save: Path

    @property
    def ckpt(self) -> Path:
        return self.save / "ckpt"


def torchrun(nproc: int, args: list[str], save: Path, *, fault: str | None = None, max_restarts: int = 0,
             ckpt_path: Path | None = None, timeout: float = 200, agent: bool = False,
             env: dict[str, str] | None = None) -> Run:
    """torchrun --standalone [--max-restarts R] -m rlrun.ppo ARGS --save_path SAVE --ckpt_path SAVE/ckpt (forked
    ranks unless `agent` or `max_restarts` needs torchrun's agent: helpers.run_module_world); `env`: more
    variables."""
    args = [*args, "--save_path", str(save), "--ckpt_path", str(ckpt_path or save / "ckpt")]
    extra = dict(env or {})
    env = subprocess_env(**({"RLRUN_FAULT": fault} if fault else {}), **extra)
    if not fault:
        env.pop("RLRUN_FAULT", None)
    start = time.monotonic()
    try:
        returncode, output = run_module_world(nproc, "rlrun.ppo", args, env, timeout, max_restarts, agent)
    except subprocess.TimeoutExpired:
        pytest.fail(f"timed out after {timeout} s: rlrun.ppo {' '.join(args)}")
    return Run(returncode, output, read_metrics(save), time.monotonic() - start, save)


def _ok(run: Run) -> None:
    assert run.returncode == 0, run.output[-4000:]



def _assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = load_file(a), load_file(b)
    assert ta.keys() == tb.keys()
    different = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not different, f"{len(different)} tensors differ between {a} and {b}, e.g. {different[:3]}"


def _assert_same_final_models(run: Run, ref: Run) -> None:
    _assert_same_tensors(run.save / "model.safetensors", ref.save / "model.safetensors")
    _assert_same_tensors(run.save / "critic" / "model.safetensors", ref.save / "critic" / "model.safetensors")


def _copy_checkpoints(src: Run, dst_root: Path, *steps: int) -> None:
    dst_root.mkdir(parents=True)
    for step in steps:
        shutil.copytree(ckpt.step_dir(str(src.ckpt), step), ckpt.step_dir(str(dst_root), step))


def _assert_clean_newest(root: Path, step: int) -> None:
    """The newest checkpoint is `step`, validates, and nothing unfinished is left behind."""
    assert not [p.name for p in root.iterdir() if p.name.startswith(".tmp_step_")]
    found, warnings = ckpt.find_latest(str(root))
    assert warnings == []
    assert found is not None and found.step == step
    ckpt.validate(found.path)
    assert json.loads((root / ckpt.LATEST).read_text())["step"] == step


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Run:
    """Uninterrupted: 2 ranks, GAE with critic and reference, 2N steps, a checkpoint every N."""
    run = torchrun(2, SMALL + GAE + ["--max_steps", str(STEPS), "--save_steps", str(N)],
                   tmp_path_factory.mktemp("reference"))
    _ok(run)
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    assert sorted(p.name for p in run.ckpt.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    return run


# ---- exact resume --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_is_exact_and_skips_a_corrupt_newest_checkpoint(reference, tmp_path):
    """Resuming from step N reproduces the uninterrupted run: metrics of steps N+1..2N (timings aside),
    final policy and critic weights, bit for bit. The checkpoint directory also holds a step-2N
    checkpoint with a truncated shard: it is skipped with a warning, and replaced by a good one."""
    _copy_checkpoints(reference, tmp_path / "ckpt", N, STEPS)
    shard = tmp_path / "ckpt" / "step_00000004" / "actor" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    run = torchrun(2, SMALL + GAE + ["--max_steps", str(STEPS), "--save_steps", str(N), "--load_checkpoint"], tmp_path)
    _ok(run)
    warnings = re.findall(r"warning\] skipping checkpoint (\S+): file (\S+) has", run.output)
    assert warnings == [(ckpt.step_dir(str(run.ckpt), STEPS), "actor/__1_0.distcp")], run.output[-3000:]
    assert f"resumed from {ckpt.step_dir(str(run.ckpt), N)} at step {N}" in run.output
    assert [m["step"] for m in run.metrics] == list(range(N + 1, STEPS + 1))
    assert untimed(run.metrics) == untimed(reference.metrics[N:])
    _assert_same_final_models(run, reference)
    _assert_clean_newest(run.ckpt, STEPS)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_all_checkpoints_corrupt_is_one_clear_error(reference, tmp_path):
    """Checkpoints exist and none is intact: starting over silently would lose the run, so --load_checkpoint stops
    with one line naming each damaged checkpoint and the way out, and deletes nothing."""
    _copy_checkpoints(reference, tmp_path / "ckpt", N, STEPS)
    (tmp_path / "ckpt" / "step_00000002" / "actor" / "__0_0.distcp").unlink()
    (tmp_path / "ckpt" / "step_00000004" / ckpt.COMPLETE).write_text("{garbage")
    run = torchrun(1, SMALL + GAE + ["--max_steps", "1", "--save_steps", str(N), "--load_checkpoint"], tmp_path,
                   agent=True)
    assert run.returncode != 0
    assert run.output.count("warning] skipping checkpoint") == 2, run.output[-3000:]
    failed = [line for line in run.output.splitlines() if ": FAILED (" in line]
    assert len(failed) == 1, run.output[-3000:]
    assert (f"CheckpointError: --load_checkpoint: no intact checkpoint in {run.ckpt} ({run.ckpt}/step_00000004: "
            "unreadable COMPLETE.json") in failed[0]
    assert "step_00000002: file actor/__0_0.distcp is missing" in failed[0] and "fresh --ckpt_path" in failed[0]
    assert run.output.count("Traceback") == 1 and "ChildFailedError" in run.output  # torchrun's own, nothing else
    assert run.metrics == []
    assert sorted(p.name for p in run.ckpt.iterdir()) == ["step_00000002", "step_00000004"]


# ---- elastic restarts after a SIGKILL ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_mid_step_restarts_and_matches_the_uninterrupted_run(reference, tmp_path):
    """Rank 1 is SIGKILLed in the train phase of step N+1; torchrun restarts the group, which resumes
    from step N: one metrics line per step, and the same result as if nothing had happened."""
    run = torchrun(2, SMALL + GAE + ["--max_steps", str(STEPS), "--save_steps", str(N), "--load_checkpoint"],
                   tmp_path, fault=f"train:{N}:1", max_restarts=2)
    _ok(run)
    # A resume inside a run that was started fresh means the group died and torchrun restarted it.
    # (Which rank torchrun names as failed is a race: rank 0 often exits first on the broken connection.)
    assert f"resumed from {ckpt.step_dir(str(run.ckpt), N)} at step {N}" in run.output
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    assert untimed(run.metrics) == untimed(reference.metrics)
    _assert_same_final_models(run, reference)
    _assert_clean_newest(run.ckpt, STEPS)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("phase", ["save", "save_shards"])
def test_kill_mid_save_restarts_and_leaves_a_loadable_checkpoint(reference, tmp_path, phase):
    """Rank 1 is SIGKILLed while saving the step-2N checkpoint: on entering the save ("save", before
    anything is written) or after writing its shards, before the checkpoint is sealed ("save_shards").
    The restarted group resumes from step N, saves step 2N again and ends like the uninterrupted run."""
    run = torchrun(2, SMALL + GAE + ["--max_steps", str(STEPS), "--save_steps", str(N), "--load_checkpoint"],
                   tmp_path, fault=f"{phase}:{STEPS - 1}:1", max_restarts=2)
    _ok(run)
    # The group failed (whichever rank the agent saw first: the killed one, or a peer whose collective broke) ...
    assert "failed (exitcode: " in run.output, run.output[-3000:]
    # ... and the restarted one found the unfinished save, ignored it and resumed from the previous checkpoint.
    assert f"skipping checkpoint {ckpt.tmp_dir(str(run.ckpt), STEPS)}: a save that did not finish" in run.output
    assert f"resumed from {ckpt.step_dir(str(run.ckpt), N)} at step {N}" in run.output
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    assert untimed(run.metrics) == untimed(reference.metrics)
    _assert_same_final_models(run, reference)
    _assert_clean_newest(run.ckpt, STEPS)
    if phase == "save_shards":
        # The new checkpoint loads: one more step, on a single rank (a 2-rank checkpoint, resharded).
        more = torchrun(1, SMALL + GAE + ["--max_steps", str(STEPS + 1), "--save_steps", str(N), "--load_checkpoint"],
                        tmp_path)
        _ok(more)
        assert f"resumed from {ckpt.step_dir(str(run.ckpt), STEPS)} at step {STEPS}" in more.output
        assert [m["step"] for m in more.metrics] == list(range(1, STEPS + 2))
        _assert_clean_newest(more.ckpt, STEPS + 1)


# ---- preemption ----------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_notice_one_rank_hears_mid_save_stops_every_rank_and_the_requeued_job_resumes_exactly(reference, tmp_path):
    """Rank 1 alone hears SIGTERM while it writes the step-N checkpoint (issue 64: nothing handled it, and a
    preempted job lost everything since the last save): the save completes, both ranks stop at that step boundary
    (exit 0 under torchrun, so it restarts nothing), rank 0 says why and how to resume and writes the summary
    (outcome preempted) and the marker the Slurm script requeues on; nothing is exported. The same command as a
    requeued Slurm job (SLURM_RESTART_COUNT 1, no --load_checkpoint) resumes from step N and ends like the
    uninterrupted run: metrics, policy and critic bit for bit."""
    marker = tmp_path / "preempted"
    args = SMALL + GAE + ["--max_steps", str(STEPS), "--save_steps", str(N)]
    run = torchrun(2, args, tmp_path, fault=f"save_shards:{N - 1}:1:term", env={MARKER_ENV: str(marker)})
    _ok(run)
    saved = ckpt.step_dir(str(run.ckpt), N)
    assert "rank 1: SIGTERM received: stopping after this step" in run.output, run.output[-3000:]
    assert "rank 0: SIGTERM" not in run.output
    assert f"preempted (a notice on another rank) after step {N}: checkpoint {saved}; the same command" in run.output
    assert marker.read_text() == f"preempted after step {N}; checkpoint {saved}\n"
    assert [m["step"] for m in run.metrics] == list(range(1, N + 1))
    assert json.loads((tmp_path / "summary.json").read_text())["run"]["outcome"] == "preempted"
    assert not (tmp_path / "model.safetensors").exists()
    _assert_clean_newest(run.ckpt, N)

    requeued = torchrun(2, args, tmp_path, env={"SLURM_RESTART_COUNT": "1"})
    _ok(requeued)
    assert f"Slurm requeued this job (1 time(s)): resuming from {run.ckpt}" in requeued.output
    assert f"resumed from {saved} at step {N}" in requeued.output
    assert untimed(requeued.metrics) == untimed(reference.metrics)
    _assert_same_final_models(requeued, reference)

    # A run that saves no checkpoints (--save_steps -1, OpenRLHF's default) still saves one when a notice stops it,
    # in a directory of its own under --ckpt_path (here the one above, which holds the other run's step-N checkpoint);
    # requeued (the same job: the same run id), it resumes from that one, never from the other run's
    job = {"TORCHELASTIC_RUN_ID": "rlrun-4242"}  # what scripts/slurm/train.sh gives torchrun (--rdzv_id)
    fresh, own = tmp_path / "fresh", run.ckpt / "preempted-torchrun-rlrun-4242"
    args = SMALL + GAE + ["--max_steps", str(STEPS), "--save_steps", "-1"]
    stopped = torchrun(2, args, fresh, ckpt_path=run.ckpt, fault="train:0:1:term", env=job)
    _ok(stopped)
    assert (f"preempted (a notice on another rank) after step 1: checkpoint {ckpt.step_dir(str(own), 1)}; the same "
            f"command with --load_checkpoint --ckpt_path {own} resumes it") in stopped.output, stopped.output[-3000:]
    assert [m["step"] for m in stopped.metrics] == [1] and ckpt.step_dir(str(run.ckpt), N) != ckpt.step_dir(str(own), 1)
    again = torchrun(2, args, fresh, ckpt_path=run.ckpt, env={**job, "SLURM_RESTART_COUNT": "1"})
    _ok(again)
    assert f"Slurm requeued this job (1 time(s)): resuming from {own}" in again.output, again.output[-3000:]
    assert f"resumed from {ckpt.step_dir(str(own), 1)} at step 1" in again.output
    assert untimed(again.metrics) == untimed(reference.metrics)  # training as if it had never stopped
    _assert_same_final_models(again, reference)
    # another job (another id) finds nothing of its own there, and starts over
    other = torchrun(2, SMALL + GAE + ["--max_steps", "1", "--save_steps", "-1"], tmp_path / "other",
                     ckpt_path=run.ckpt, env={"TORCHELASTIC_RUN_ID": "rlrun-4343", "SLURM_RESTART_COUNT": "1"})
    _ok(other)
    assert ("Slurm requeued this job (1 time(s)): --save_steps -1, and no preemption saved a checkpoint of this job: "
            "starting over") in other.output
    assert "resumed from" not in other.output
    assert other.metrics[0]["reward"] == reference.metrics[0]["reward"]  # the initial policy's rollouts


# ---- resizing the world --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_on_more_then_fewer_ranks(reference, tmp_path):
    """The reference's 2-rank checkpoint continues on 4 ranks at the next step, and the checkpoint those
    4 ranks write continues on 2 (DCP reshards actor and critic; GAE, so the critic is covered too)."""
    _copy_checkpoints(reference, tmp_path / "ckpt", STEPS)
    shutil.copy(reference.save / "metrics.jsonl", tmp_path / "metrics.jsonl")
    for nproc, step in ((4, STEPS + 1), (2, STEPS + 2)):
        run = torchrun(nproc, SMALL + GAE + ["--max_steps", str(step), "--save_steps", str(N), "--load_checkpoint"],
                       tmp_path)
        _ok(run)
        assert f"resumed from {ckpt.step_dir(str(run.ckpt), step - 1)} at step {step - 1}" in run.output
        # The earlier lines are kept; the resumed run continues with the next step.
        assert [m["step"] for m in run.metrics] == list(range(1, step + 1))
        assert run.metrics[:STEPS] == reference.metrics
        _assert_clean_newest(run.ckpt, step)
        assert json.loads((run.ckpt / ckpt.step_dir("", step) / ckpt.COMPLETE).read_text())["meta"]["world_size"] == nproc
        model = AutoModelForCausalLM.from_pretrained(run.save)
        assert sum(p.numel() for p in model.parameters()) > 10_000


# ---- incompatible checkpoint ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_checkpoint_of_a_different_architecture_fails_fast_and_clearly(reference, tmp_path):
    from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config

    config = tiny_model_config()
    config.hidden_size, config.intermediate_size = 32, 96  # same layer names, other shapes
    model_dir = tmp_path / "narrow_model"
    build_causal_lm(config, seed=0).save_pretrained(model_dir)
    build_byte_tokenizer().save_pretrained(model_dir)
    _copy_checkpoints(reference, tmp_path / "ckpt", N)

    run = torchrun(2, SMALL + GAE + ["--pretrain", str(model_dir), "--remote_rm_url", "demo", "--max_steps", str(STEPS),
                                     "--save_steps", str(N), "--load_checkpoint"], tmp_path, timeout=120,
                   agent=True)
    assert run.returncode != 0
    # Every rank stops at once with the same one-line reason (none is left waiting in a collective) ...
    # (searched in the whole output: two processes' lines can end up glued together in the pipe.)
    assert run.output.count("different policy architecture") == 2, run.output[-3000:]
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: FAILED \(actor,critic,ref,engine\) in phase load: CheckpointError: checkpoint at "
                         rf"step {N} in \S+ was written for a different policy architecture", run.output), run.output[-3000:]
    assert "lm_head.weight: checkpoint [259, 64] vs model [259, 32]" in run.output
    assert "exitcode  : 1 " in run.output, run.output[-3000:]
    assert "collective failed" not in run.output and "SIGKILL" not in run.output
    # ... quickly: well before any collective timeout (--dist_timeout 30) could be involved.
    assert run.wall_s < 60, run.wall_s
    assert [m["step"] for m in run.metrics] == []
