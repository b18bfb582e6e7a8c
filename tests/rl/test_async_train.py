"""--async_train: engines generate step N+1 while the learners train on step N (one step off-policy).

Real processes (torchrun + gloo, the tiny model): engine on rank 2, actor on 0, critic on 1. Checked:
the learners' batches really come one weight version late (a synchronous run differs from step 2 on and
matches on step 1), learning still happens, and a SIGKILL mid-run resumes exactly (the batch in flight
is checkpointed)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from rlrun.cli.parser import parse_args
from rlrun.plan.plan import lay_out
from helpers import untimed
from test_resume import N, SMALL, STEPS, _assert_same_final_models, _ok, torchrun

LAYOUT = ["--actor_num_gpus_per_node", "1", "--critic_num_gpus_per_node", "1", "--vllm_num_engines", "1"]
GAE = ["--advantage_estimator", "gae", "--init_kl_coef", "0.01", "--save_value_network"]
ASYNC = SMALL + GAE + LAYOUT + ["--async_train"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = torchrun(3, ASYNC + ["--max_steps", str(STEPS), "--save_steps", str(N)], tmp_path_factory.mktemp("ref"))
    _ok(run)
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    assert (run.ckpt / "step_00000002" / "pending_rollout.pt").exists()  # step 3's batch, generated before the save
    # The critic lives on rank 1 only: its export must still hold its weights (transformers writes on rank 0 only).
    assert len(load_file(run.save / "critic" / "model.safetensors")) > 10
    return run


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_batches_lag_one_weight_version(reference, tmp_path):
    sync = torchrun(3, SMALL + GAE + LAYOUT + ["--max_steps", str(STEPS)], tmp_path)
    _ok(sync)
    a, s = untimed(reference.metrics), untimed(sync.metrics)
    # Step 1's batch comes from the initial weights either way; from step 2 on the async batch was generated
    # before step 1's update, the synchronous one after it. (Samples of slightly different weights can agree,
    # so some later step differs, not necessarily each; the vLLM lane measures the lag on every token.)
    assert a[0]["reward"] == s[0]["reward"] and a[0]["response_length"] == s[0]["response_length"]
    assert any(x["reward"] != y["reward"] or x["response_length"] != y["response_length"] for x, y in zip(a[1:], s[1:]))
    assert all(m["async/policy_lag"] == 1.0 and m["time/engine_generate"] > 0 for m in reference.metrics)
    assert "async/policy_lag" not in sync.metrics[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_mid_step_resumes_exactly(reference, tmp_path):
    """The actor is SIGKILLed while training step N+1; the restart loads step N's checkpoint, including the
    batch the engine had generated for step N+1 with weights that no longer exist anywhere else."""
    run = torchrun(3, ASYNC + ["--max_steps", str(STEPS), "--save_steps", str(N), "--load_checkpoint"], tmp_path,
                   fault=f"train:{N}:0", max_restarts=2)
    _ok(run)
    assert f"at step {N}" in run.output
    assert untimed(run.metrics) == untimed(reference.metrics)
    _assert_same_final_models(run, reference)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_async_still_learns_and_its_rollout_correction_sees_the_lag(tmp_path):
    """One step off-policy, the engine's log-probs are those of the weights before the last update: verl's token TIS
    (its decoupled_token_is preset) weighs pi_old / pi_engine, which now spreads around 1, and the run learns."""
    run = torchrun(3, ["--config", "configs/demo.yaml", "--max_steps", "40", "--async_train",
                       "--actor_num_gpus_per_node", "2", "--vllm_num_engines", "1", "--generation_backend", "native",
                       "--rollout_correction", "decoupled_token_is"], tmp_path, timeout=280)
    _ok(run)
    rewards = [m["reward"] for m in run.metrics]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards
    first, later = run.metrics[0], run.metrics[1:]
    assert abs(first["rollout_corr/kl"]) < 1e-4  # step 1's batch comes from the weights it trains from
    assert max(m["rollout_corr/kl"] for m in later) > 1e-3
    assert max(m["rollout_corr/rollout_is_std"] for m in later) > 0.05
    assert all(m["rollout_corr/rollout_is_max"] <= 2.0 + 1e-6 for m in run.metrics)  # truncated at the threshold


def _plan(*argv: str):
    cfg = parse_args(["--n_samples_per_prompt", "2", *argv]).config
    return lay_out(cfg, 4, 4)


def test_learners_group_or_a_clear_warning():
    done = _plan("--async_train", "--actor_num_gpus_per_node", "2", "--vllm_num_engines", "2",
                 "--advantage_estimator", "group_norm", "--init_kl_coef", "0")
    assert ("learners", (0, 1)) in [(g.name, g.ranks) for g in done.layout.groups] and done.layout.asynchronous
    # Engines on the actor's ranks (OpenRLHF scripts pair --async_train with --colocate_all_models): said, synchronous.
    for argv in (["--async_train"], ["--async_train", "--colocate_all_models", "--vllm_num_engines", "4"]):
        shared = _plan(*argv)
        assert not shared.layout.asynchronous
        assert any(w.startswith("--async_train ignored, this run is synchronous") for w in shared.warnings), shared.warnings
    queue = _plan("--async_train", "--async_queue_size", "2", "--actor_num_gpus_per_node", "2", "--vllm_num_engines", "2",
                  "--advantage_estimator", "group_norm", "--init_kl_coef", "0")
    assert any("--async_queue_size 2 ignored" in w for w in queue.warnings) and queue.layout.asynchronous
