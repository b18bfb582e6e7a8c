"""The in-process vLLM host (external_launcher): the host choice and its refusals (main venv, no vLLM needed),
then the real engine in the lane venv: weight-sync parity with the actor at tensor parallel 1 and 2, and rlrun
end to end (learning, same rewards as the child host, tensor parallel 2 with --colocate_all_models)."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from rlrun.cli.parser import parse_args
from rlrun.engines.protocol import SamplingSettings
from rlrun.engines.vllm.placement import choose_host, whole_world_problem
from rlrun.engines.vllm.engine import VLLMOptions
from rlrun.engines.vllm.in_process import InProcessEngine, kept_host_rng
from rlrun.launch.layout import Layout, LayoutRequest, Role
from rlrun.plan.placement import plan_layout
from rlrun.models.tiny import EOS_ID, PAD_ID, build_byte_tokenizer, build_causal_lm, tiny_model_config
from rlrun.plan.plan import lay_out
from rlrun.runtime.errors import ConfigError

from vllm_lane import LANE_PYTHON, REPO, lane_env, needs_lane

NO_MODELS = dict(need_critic=False, need_ref=False, need_reward=False)


def _layout(world: int, **request: object) -> Layout:
    return plan_layout(LayoutRequest(**NO_MODELS, **request), world, world)  # type: ignore[arg-type]


# ---- host choice (pure) --------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "tp"), [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_whole_world_layouts_get_the_in_process_host(world, tp):
    for layout in (_layout(world, colocate_all_models=True, vllm_tensor_parallel_size=tp),
                   _layout(world, vllm_tensor_parallel_size=tp)):  # the default layout: engines on every rank too
        assert whole_world_problem(layout, tp) is None
        assert choose_host("auto", layout, tp) == "in_process"
        assert choose_host("in_process", layout, tp) == "in_process"
        assert choose_host("child", layout, tp) == "child"  # the child host stays available on request


def test_engines_on_a_subset_get_the_child_host_and_in_process_is_refused():
    disagg = _layout(3, actor=_sized(1), vllm_num_engines=1, vllm_tensor_parallel_size=2)  # actor 0, engine 1-2
    assert disagg.ranks_of(Role.ENGINE) == (1, 2)
    assert choose_host("auto", disagg, 2) == "child"
    with pytest.raises(ConfigError, match=r"--vllm_engine_host in_process: the engine ranks \[1, 2\] are not the whole "
                                          r"world of 3 ranks .*--colocate_all_models.*--vllm_engine_host child"):
        choose_host("in_process", disagg, 2)


def test_non_consecutive_tensor_parallel_blocks_are_refused():
    # vLLM's tensor-parallel groups are consecutive world ranks; an engine laid out otherwise cannot be served
    layout = Layout(world_size=4, ranks_per_node=4, roles={Role.ACTOR: (0, 1, 2, 3), Role.ENGINE: (0, 1, 2, 3)},
                    engines=((0, 2), (1, 3)), groups=())
    assert "not consecutive blocks of tensor parallel 2" in (whole_world_problem(layout, 2) or "")
    assert choose_host("auto", layout, 2) == "child"


def _sized(n: int):
    from rlrun.launch.layout import RoleRequest

    return RoleRequest(gpus_per_node=n)


def test_planning_refuses_in_process_on_a_subset_before_anything_starts():
    argv = ["--generation_backend", "vllm", "--vllm_engine_host", "in_process", "--actor_num_gpus_per_node", "1",
            "--vllm_num_engines", "1", "--advantage_estimator", "group_norm", "--init_kl_coef", "0",
            "--rollout_batch_size", "4", "--n_samples_per_prompt", "2", "--train_batch_size", "8",
            "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4"]
    cfg = parse_args(argv).config
    with pytest.raises(ConfigError, match=r"engine ranks \[1\] are not the whole world of 2 ranks"):
        lay_out(cfg, 2, 2)
    auto = parse_args([a if a != "in_process" else "auto" for a in argv]).config
    assert lay_out(auto, 2, 2).layout.ranks_of(Role.ENGINE) == (1,)  # auto: the same layout runs with the child host


def test_in_process_engine_called_directly_on_a_subset_refuses_before_importing_vllm():
    model = build_causal_lm(tiny_model_config(), seed=0)
    sampling = SamplingSettings(1.0, 1.0, 4, PAD_ID, (EOS_ID,))
    disagg = _layout(2, actor=_sized(1), vllm_num_engines=1)
    with pytest.raises(ConfigError, match=r"in-process vLLM engine .* cannot run here: the engine ranks \[1\] are not "
                                          r"the whole world of 2 ranks.*--vllm_engine_host child"):
        InProcessEngine(model, build_byte_tokenizer(), sampling, torch.device("cpu"), VLLMOptions(1, 0, 64),
                        layout=disagg, world_size=2, exchange=None)  # type: ignore[arg-type]
    whole = _layout(2)
    with pytest.raises(ConfigError, match=r"the layout is for 2 ranks but torch.distributed has 4"):
        InProcessEngine(model, build_byte_tokenizer(), sampling, torch.device("cpu"), VLLMOptions(0, 0, 64),
                        layout=whole, world_size=4, exchange=None)  # type: ignore[arg-type]


def test_kept_host_rng_undoes_a_reseed():
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    with kept_host_rng(torch.device("cpu")):  # what vLLM does at construction: reseed everything to LLM(seed=0)
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        random.random()
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected


def test_vllm_flags_are_reported_only_without_the_vllm_backend():
    flags = ["--vllm_enable_sleep", "--vllm_engine_host", "child"]
    hf = {line.split(":")[0] for line in parse_args(flags).ignored}
    assert {"--vllm_enable_sleep", "--vllm_engine_host"} <= hf
    vllm = {line.split(":")[0] for line in parse_args(flags + ["--generation_backend", "vllm"]).ignored}
    assert not {"--vllm_enable_sleep", "--vllm_engine_host"} & vllm
    auto = parse_args(flags)  # `auto` resolves after parsing: vLLM's flags act if it picks vllm, are reported if not
    assert auto.ignored_under("native") == auto.ignored
    assert not {line.split(":")[0] for line in auto.ignored_under("vllm")} & {"--vllm_enable_sleep", "--vllm_engine_host"}


# ---- the real engine (lane venv) -------------------------------------------------------------------


def _torchrun(args: list[str], nproc: int, timeout: float, **env: str) -> subprocess.CompletedProcess:
    cmd = [str(LANE_PYTHON), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    return subprocess.run(cmd, cwd=REPO, env=lane_env(**env), capture_output=True, text=True, timeout=timeout)


@needs_lane
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_in_process_engine_matches_the_actor_after_each_training_step(tp):
    proc = _torchrun([str(REPO / "tests/engines/vllm_in_process_check.py"), str(tp)], 2, timeout=420)
    reports = sorted((json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
                      if line.startswith("RESULT ")), key=lambda r: r["rank"])
    assert proc.returncode == 0 and len(reports) == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Invalid process group" not in proc.stderr  # closed before the default group, without vLLM's own cleanup
    for report in reports:
        assert report["tp"] == tp
        assert report["rng_kept"] and report["set_num_threads_kept"], report  # vLLM's side effects undone
        assert report["engine_on_meta"], report  # weight sync's loader: the rank keeps no copy of the policy
        checks = report["checks"]
        # round 0: initial weights; 1: after an optimizer step, written in place; 2: another step, new buffers
        assert [c["round"] for c in checks] == [0, 1, 2]
        for c in checks:
            assert c["greedy_equal"], c  # engine greedy == actor (HF) greedy on the synced weights
            assert c["max_logprob_diff"] < 1e-4, c  # sampled-token log-probs == actor teacher forcing
            assert c["rows"] == 6 and c["lengths_match"], c  # each rank gets exactly its own rows back
            assert c["repeat_same_samples"] and c["other_seed_differs"], c  # the seeds decide the samples (one per call)
        assert checks[0]["greedy_first"] != checks[1]["greedy_first"] != checks[2]["greedy_first"]  # weights changed
        assert report["all_reduce_after_close"] == 2.0  # the trainer's default group survives the engine's close
    # the ranks asked different prompts and got different rows (with tensor parallel 2 both ran all 12)
    assert reports[0]["checks"][0]["greedy_first"] != reports[1]["checks"][0]["greedy_first"]


DEMO = ["-m", "rlrun.ppo", "--config", "configs/demo.yaml", "--generation_backend", "vllm", "--dist_timeout", "240"]


def _train(args: list[str], save: Path, timeout: float = 540, **env: str) -> tuple[str, list[dict]]:
    proc = _torchrun(DEMO + args + ["--save_path", str(save)], 2, timeout, **env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    metrics = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # the engine sampled with exactly the actor's weights (stale weights give ~1e-1 or more)
        assert m["rollout/engine_vs_actor_logprob_diff"] < 1e-3, m
    return out, metrics


@needs_lane
@pytest.mark.slow
def test_in_process_host_learns_and_samples_exactly_as_the_child_host(tmp_path):
    """And the child host's run is the same, and learns, although each rank's child is SIGKILLed (as an out-of-memory
    kill would be) in the middle of step 6's generation (its 6th generate request): the rank starts a new child, gives
    it the last sync's weights from its host copy and sends the request again with the same seeds."""
    steps = ["--max_steps", "12"]  # the demo's reward: ~0.1 over steps 1-3, ~0.39 over 9-12
    out, inproc = _train(steps, tmp_path / "in_process")  # the default layout: every rank an engine -> in-process
    assert out.count("in-process vLLM engine ready") == 2 and "vLLM engine child started" not in out, out[-3000:]
    # in-process, each sync's gathered tensors go straight into vLLM (no rank keeps a copy); the child host re-reads
    # the rank's copy: the same weights either way, so the same run
    assert "no rank keeps a copy of the policy" in out, out[-3000:]
    rewards = [m["reward"] for m in inproc]
    assert len(rewards) == 12
    assert np.mean(rewards[-4:]) > np.mean(rewards[:3]) + 0.1, [round(r, 3) for r in rewards]  # ~0.08 -> ~0.23
    out, child = _train(steps + ["--vllm_engine_host", "child"], tmp_path / "child",
                        RLRUN_VLLM_CHILD_FAULT="generate:5:kill")
    assert out.count("vLLM engine child started") == 2 and "in-process vLLM" not in out, out[-3000:]
    restarts = [line for line in out.splitlines() if "restarting it with the last sync's weights" in line]
    assert len(restarts) == 2 and all("died while generating (killed by signal 9)" in r for r in restarts), out[-3000:]
    # every engine rank's restarts, over the run: counted in the step metrics (from step 6 on), never trained as rows
    assert [m["engine/restarts"] for m in child] == [0.0] * 5 + [2.0] * 7, [m["engine/restarts"] for m in child]
    assert "keeps a host copy of each" in out
    # engine ranks == actor ranks on the child host: each rank packs its own gathers into the staging buffers it
    # streams to its child
    assert out.count("weight syncs stream bucket by bucket to the vLLM child") == 2, out[-3000:]
    # same seed, same weights, and the same seed per generate call (no --vllm_seeded_requests: the sampler is seeded
    # once per call from the rows' seeds): the two hosts give the same run, step for step
    assert [m["reward"] for m in child] == rewards


@needs_lane
@pytest.mark.slow
def test_in_process_tensor_parallel_2_with_colocate_all_models_trains(tmp_path):
    # with per-request seeds: every peer submits the same seeded requests (without: test_in_process_engine_matches...)
    out, metrics = _train(["--colocate_all_models", "--vllm_tensor_parallel_size", "2", "--max_steps", "2",
                           "--vllm_seeded_requests"], tmp_path)
    assert out.count("in-process vLLM engine ready") == 2 and "tensor parallel 2)" in out, out[-3000:]
    assert "no rank keeps a copy of the policy" in out, out[-3000:]  # both ranks load every full tensor, keep a shard
    assert [m["step"] for m in metrics] == [1, 2] and all(m["response_length"] > 0 for m in metrics)  # 2: synced
    assert "Invalid process group" not in out


@needs_lane
@pytest.mark.slow
def test_lora_adapters_alone_reach_vllm_each_sync_on_both_hosts(tmp_path):
    """A saved LoRA adapter directory as --pretrain on vLLM engines: vLLM reads the base model's own files at start
    (linked, not written: the engines start from the base alone, not base + adapter merged), each sync sends the
    adapters alone and vLLM loads them under a new name (engines/vllm/lora.py). The engines sample exactly the
    actor's policy every step (the sync's diff metric), on the child host also after its children are SIGKILLed at
    step 6 (the new child reads the base again and is given the last sync's adapters), and the policy learns."""
    from helpers import save_tiny_base, save_trained_adapter
    from rlrun.config.model import PretrainedConfig

    lora = tmp_path / "lora"
    save_trained_adapter(PretrainedConfig(pretrain=save_tiny_base(tmp_path / "base"), lora_rank=8, lora_alpha=16,
                                          target_modules=("all-linear",)), lora)
    args = ["--pretrain", str(lora), "--remote_rm_url", "demo", "--max_steps", "16"]
    out, child = _train(args + ["--vllm_engine_host", "child", "--max_engine_restarts", "1"], tmp_path / "child",
                        RLRUN_VLLM_CHILD_FAULT="generate:5:kill")
    assert "weight sync: LoRA adapters only (the vllm engines keep the base weights" in out, out[-3000:]
    assert f"vLLM engines read the base weights at start from {tmp_path / 'base'} (linked)" in out, out[-3000:]
    assert "weight syncs stream bucket by bucket" not in out and "keeps a host copy" not in out, out[-3000:]
    assert [m["engine/restarts"] for m in child] == [0.0] * 5 + [2.0] * 11, [m["engine/restarts"] for m in child]
    rewards = [m["reward"] for m in child]
    assert np.mean(rewards[-4:]) > np.mean(rewards[:3]) + 0.1, [round(r, 3) for r in rewards]  # it learns
    out, inproc = _train(args, tmp_path / "in_process")  # every rank an engine: the in-process host
    assert out.count("in-process vLLM engine ready") == 2 and "adapters only (the vllm engines" in out, out[-3000:]
    # the same base weights, the same adapters, the same seeds: the two hosts (one restarted) give the same run
    assert [m["reward"] for m in inproc] == rewards, ([m["reward"] for m in inproc], rewards)
