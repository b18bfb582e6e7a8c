"""rlrun end to end with --generation_backend vllm (lane venv, 2 ranks, real vLLM child engines)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from vllm_lane import LANE_PYTHON, REPO, lane_env, needs_lane

pytestmark = [needs_lane, pytest.mark.slow]

DEMO = ["--config", "configs/demo.yaml", "--generation_backend", "vllm", "--dist_timeout", "240"]
DISAGG = ["--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1"]  # rank 0 actor, rank 1 engine


def run(args: list[str], save: Path, timeout: float = 480, nproc: int = 2, **env: str) -> tuple[int, str, list[dict]]:
    cmd = [str(LANE_PYTHON), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", "rlrun.ppo",
           *args, "--save_path", str(save)]
    proc = subprocess.run(cmd, cwd=REPO, env=lane_env(**env), capture_output=True, text=True, timeout=timeout)
    metrics_file = save / "metrics.jsonl"
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, metrics


def _check_trained(code: int, out: str, metrics: list[dict], steps: int) -> None:
    assert code == 0, out[-4000:]
    assert "generation backend vllm" in out
    assert [m["step"] for m in metrics] == list(range(1, steps + 1)), out[-2000:]
    for m in metrics:
        # vLLM's sampled-token log-probs vs the actor's old log-probs on the same weights: the sync worked
        # (stale or wrong weights give differences of order 1 on this model)
        assert m["rollout/engine_vs_actor_logprob_diff"] < 1e-3, m
        assert m["response_length"] > 0
    assert (Path(out.split("saved the policy (Hugging Face format) to ")[-1].split()[0]) / "config.json").exists()


def test_disaggregated_async_engine_lags_exactly_one_weight_version(tmp_path):
    """Rank 0 actor, rank 1 a vLLM engine, --async_train with OpenRLHF's train/rollout mismatch correction: the engine
    rank keeps no policy (each sync streams through two bucket buffers into the child's reload); step 1's batch comes
    from the weights the actor still has (diff ~0, fp32 on CPU: nothing clipped), and every later batch was generated
    before the previous update, so the actor's old log-probs differ from the engine's by the size of one update (the
    lag is real) and the correction, which reads the engine's log-probs, sees it."""
    code, out, metrics = run(DEMO + DISAGG + ["--max_steps", "4", "--async_train", "--is_correction_level", "token",
                                              "--is_correction_mode", "clip"], tmp_path)
    assert code == 0, out[-4000:]
    assert "generation backend vllm" in out and [m["step"] for m in metrics] == [1, 2, 3, 4], out[-2000:]
    assert all(m["response_length"] > 0 for m in metrics)
    assert (Path(out.split("saved the policy (Hugging Face format) to ")[-1].split()[0]) / "config.json").exists()
    assert "rank 1: weight syncs stream bucket by bucket to the vLLM child" in out, out[-3000:]
    diffs = [m["rollout/engine_vs_actor_logprob_diff"] for m in metrics]
    assert diffs[0] < 1e-3 and all(d > 1e-3 for d in diffs[1:]), diffs
    assert all(m["async/policy_lag"] == 1.0 for m in metrics)
    first = metrics[0]
    assert abs(first["rollout_corr/kl"]) < 1e-3 and first["rollout_corr/is_filter_frac"] == 0.0, first
    assert max(abs(m["rollout_corr/kl"]) for m in metrics[1:]) > abs(first["rollout_corr/kl"]), metrics


def test_multi_turn_agent_episodes_on_vllm_go_on_when_the_engine_child_dies_mid_sync(tmp_path):
    """The two-turn example environment on a disaggregated vLLM engine: observation tokens carry engine log-prob 0 and
    mask 0, so the engine/actor diff (over action tokens) still shows exact weights. The engine rank's child is
    SIGKILLed during the weight sync after step 2 (its 3rd "stream", the first sync's included): the rank takes the
    rest of the sync without it (the actor's broadcast goes on: the sync is collective), then starts a new child and
    gives it the sync from its host copy. Step 3's diff stays ~0: the new child serves exactly the current weights."""
    code, out, metrics = run(["--config", "configs/multiturn_demo.yaml", "--generation_backend", "vllm",
                              "--dist_timeout", "240", "--max_steps", "3"] + DISAGG, tmp_path,
                             RLRUN_VLLM_CHILD_FAULT="stream:2:kill")
    _check_trained(code, out, metrics, 3)
    for m in metrics:
        assert m["agent/turns"] == 2.0 and m["agent/observation_tokens"] > 10, m
    assert [m["engine/restarts"] for m in metrics] == [0.0, 0.0, 1.0], metrics
    restarts = [line for line in out.splitlines() if "restarting it with the last sync's weights" in line]
    assert len(restarts) == 1 and "rank 1: vLLM engine child" in restarts[0], out[-3000:]
    assert "died while loading weights" in restarts[0] and "restart 1 of the run" in restarts[0], restarts


def test_a_gateway_source_samples_on_in_process_vllm_engines(tmp_path):
    """A TRL environment class (--environment_factory) on the default layout's in-process vLLM engines: its episodes'
    calls reach vLLM through the token gateway, each with its own seed (--vllm_seeded_requests: the gateway's keys),
    and the rows are vLLM's exact ids and log-probs (the engine/actor diff stays ~0 as the weights move)."""
    code, out, metrics = run(DEMO + ["--environment_factory", "examples/trl_env/chars_env.py:CharsEnv",
                                     "--remote_rm_url", "demo", "--vllm_seeded_requests", "--max_steps", "3",
                                     "--rollout_batch_size", "8", "--train_batch_size", "32"], tmp_path)
    _check_trained(code, out, metrics, 3)
    assert out.count("in-process vLLM engine ready") == 2, out[-3000:]
    assert all(m["agent/failed"] == 0 and m["agent/turns"] == 1 and m["reward"] >= 0.5 for m in metrics), metrics


def test_partial_rollout_continues_responses_on_vllm(tmp_path, long_tailed_base):
    """--partial_rollout on a tensor-parallel vLLM engine (rank 0 actor, ranks 1-2 one engine at TP 2; the chunked
    path: --partial_rollout_tokens per call) with a long-tailed policy: it trains, no sample is more than
    --max_staleness versions old, and step 1 (generated and trained on the initial weights) matches the actor token
    for token, so both engine ranks' pools reached the one vLLM child together. (Whether samples span versions
    depends on timing; the pool tests check the chunked path's carry-over and the ranks' vote deterministically.)

    The tensor-parallel child: rank 1 hosts it with 2 workers (vLLM's mp executor), rank 2 hands it its prompts and
    gets its rows back; only rank 1 receives the weights (the sync group is ranks 0 and 1), streaming each bucket into
    the safetensors file in /dev/shm both workers read."""
    code, out, metrics = run(DEMO + DISAGG + ["--pretrain", long_tailed_base, "--remote_rm_url", "demo", "--generate_max_len",
                                              "32", "--actor_learning_rate", "1e-4", "--rollout_batch_size", "8",
                                              "--n_samples_per_prompt", "2", "--train_batch_size", "16",
                                              "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "8",
                                              "--max_steps", "5", "--async_train", "--partial_rollout",
                                              "--partial_rollout_tokens", "8", "--vllm_tensor_parallel_size", "2"],
                             tmp_path / "run", timeout=600, nproc=3)
    assert code == 0, out[-4000:]
    assert "generation backend vllm" in out
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert metrics[0]["rollout/engine_vs_actor_logprob_diff"] < 1e-3 and metrics[0]["async/staleness_max"] == 0
    assert all(1 <= m["async/staleness_mean"] <= m["async/staleness_max"] <= 2 for m in metrics[1:])
    assert "tensor parallel 2" in out and out.count("vLLM engine child started") == 1, out[-3000:]
    assert "rank 1: weight syncs stream bucket by bucket into the weights file" in out, out[-3000:]
    groups = dict(re.findall(r"^(\d+)\s+\|.*\|\s+(\S+)$", out, re.M))  # the layout table: rank -> its groups
    assert "sync" in groups["1"].split(",") and "sync" not in groups["2"].split(","), out[-3000:]


def test_vision_language_grpo_on_a_vllm_engine(tmp_path):
    """The VLM demo (tiny Qwen2.5-VL, image prompts; 2 actor ranks) with a disaggregated vLLM engine: vLLM gets each prompt's
    images and expands them to the same tokens as rlrun's processor (the rows the actor scores), and its sampled-token
    log-probs match the actor's with the images (the multimodal positions and pixels agree on both sides). The lane
    has no torchvision build for its CPU torch: tests/engines/no_torchvision stands in for the video half of the
    processor, which images never use."""
    code, out, metrics = run(["--config", "configs/vlm_demo.yaml", "--generation_backend", "vllm", "--dist_timeout",
                              "240", "--max_steps", "2", "--actor_num_gpus_per_node", "2", "--vllm_num_engines", "1"],
                             tmp_path, nproc=3, RLRUN_CACHE=str(tmp_path / "cache"),
                             PYTHONPATH=str(REPO / "tests" / "engines" / "no_torchvision"))
    assert code == 0, out[-4000:]
    assert "generation backend vllm" in out and [m["step"] for m in metrics] == [1, 2], out[-2000:]
    # both actor ranks send their shards of the VLM (vision tower included) to the engine's child, bucket by bucket
    assert "each of the 2 actor ranks sends its own shard" in out, out[-3000:]
    for m in metrics:  # step 2 after one sync of the whole VLM
        # The engines never sample the 4 vision tokens, which renormalises vLLM's distribution over the rest (~1-2% of
        # the mass on this fresh tiny model: measured diffs 0.011, 0.019, 0.023); wrong pixels or positions on either
        # side (or an engine started from dummy weights: vLLM's in-model image normalisation) give 0.1-0.8, and
        # stale weights after this learning rate's updates ~0.3.
        assert m["rollout/engine_vs_actor_logprob_diff"] < 0.05, m


def test_colocated_tensor_parallel_child_engine_trains_and_is_restarted_from_its_weights_file(tmp_path):
    """One engine of tensor parallel 2 on both actor ranks, hosted by a child on rank 0: rank 0 packs each bucket of
    its own gathers into the workers' weights file, rank 1 only takes part in the gathers (it keeps nothing); with
    per-request seeds (the other child-host runs: one seed per generate call). The child is SIGKILLed on its 2nd
    generate request (step 2): rank 0 starts a new one (2 new workers), which reads the weights file again (at tensor
    parallel > 1 the file is the copy a restart needs: no other is kept), and step 2's exact match shows it serves
    the weights synced after step 1."""
    code, out, metrics = run(DEMO + ["--max_steps", "2", "--vllm_engine_host", "child", "--colocate_all_models",
                                     "--vllm_tensor_parallel_size", "2", "--vllm_seeded_requests"], tmp_path,
                             timeout=600, RLRUN_VLLM_CHILD_FAULT="generate:1:kill")
    _check_trained(code, out, metrics, 2)
    assert out.count("vLLM engine child started") == 1, out[-3000:]
    assert "rank 0: weight syncs stream bucket by bucket into the weights file" in out, out[-3000:]
    assert "keeps no copy of the policy" in out and "keeps a host copy" not in out, out[-3000:]
    restarts = [line for line in out.splitlines() if "restarting it with the last sync's weights" in line]
    assert len(restarts) == 1 and "rank 0: vLLM engine child" in restarts[0], out[-3000:]
    assert [m["engine/restarts"] for m in metrics] == [0.0, 1.0], metrics


def test_engine_child_that_keeps_failing_ends_the_job_with_one_line(tmp_path):
    # the child dies on its second generate request (step 2), and the one started in its place as it starts
    code, out, _ = run(DEMO + DISAGG + ["--max_steps", "4", "--max_engine_restarts", "1"], tmp_path, timeout=420,
                       RLRUN_VLLM_CHILD_FAULT="generate:1:kill,start:1+:kill")
    assert code != 0, out[-3000:]
    failed = [line for line in out.splitlines() if line.startswith("[rlrun") and "FAILED (" in line]
    assert len(failed) == 1, out[-3000:]
    assert "rank 1" in failed[0] and "phase generate at step 2" in failed[0], failed[0]
    assert "EngineChildError: vLLM engine child" in failed[0] and "died while starting vLLM (killed by signal 9)" in failed[0]
    assert "restarting it with the last sync's weights (restart 1 of the run" in out, out[-3000:]
    assert "not restarted again: 1 of 1 restarts (--max_engine_restarts) within the last 3600 s" in failed[0], failed[0]
