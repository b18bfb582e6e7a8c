"""`torchrun -m rlrun.ppo --deepspeed_enable_sleep` end to end (CPU, gloo, 2 ranks, the embedded tiny model):
with every role colocated (actor, critic, reference and the engine on both ranks, where sleeping matters), a
GAE run that checkpoints every step gives the same metrics and the same final weights, bit for bit, with and
without sleep, for --strategy fsdp and --strategy deepspeed (ZeRO-2)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import load_file

from helpers import run_rlrun, untimed

SMALL = ["--config", "configs/demo.yaml", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2",
         "--train_batch_size", "8", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "2",
         "--generate_max_len", "8", "--dist_timeout", "60", "--advantage_estimator", "gae", "--init_kl_coef", "0.01",
         "--colocate_all_models", "--max_steps", "2", "--save_steps", "1"]
STRATEGIES = {"fsdp": ["--strategy", "fsdp"], "deepspeed": ["--strategy", "deepspeed", "--zero_stage", "2"]}



@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_sleep_changes_nothing_but_memory(strategy, tmp_path):
    if strategy == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'rlrun[deepspeed]')")
    runs = {}
    for sleep in (False, True):
        save = tmp_path / f"sleep{int(sleep)}"
        args = SMALL + STRATEGIES[strategy] + ["--ckpt_path", str(save / "ckpt")] + (["--deepspeed_enable_sleep"] if sleep else [])
        res = run_rlrun(2, args, save, timeout=140)
        assert res.returncode == 0, res.output[-4000:]
        assert [m["step"] for m in res.metrics] == [1, 2]
        runs[sleep] = (save, res)
    (plain_dir, plain), (slept_dir, slept) = runs[False], runs[True]
    assert "sleep:" not in plain.output
    # The plan is logged once, and each kind of move once with its size.
    assert slept.output.count("--sleep: each model's parts are awake only in these phases") == 1
    assert ("ranks 0,1 (actor, critic, ref, engine): actor parameters: score, train_actor, sync; actor optimizer "
            "states: train_actor; critic parameters: score, train_critic; critic optimizer states: train_critic; "
            "ref parameters: score") in slept.output
    for line in ("sleep: actor parameters (", " moved off the device) at generate",
                 "sleep: actor optimizer states and parameters (", " moved off the device) at train_critic",
                 "sleep: ref parameters (", "sleep: critic parameters ("):
        assert line in slept.output, line
    assert slept.output.count("sleep: actor parameters (") == 1
    assert untimed(slept.metrics) == untimed(plain.metrics)
    a, b = load_file(plain_dir / "model.safetensors"), load_file(slept_dir / "model.safetensors")
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]
    assert sorted(p.name for p in (slept_dir / "ckpt").iterdir()) == ["latest", "step_00000001", "step_00000002"]
