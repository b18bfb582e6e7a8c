"""bench/real_env.py's training job, dry-run as the bench runs it (the bench itself trains for minutes: its numbers
are in bench/README.md): the real SmolLM2-135M-Instruct GGUF file as --pretrain, the verifiers taskset
examples/tasksets/sums_taskset by id, its 1,400 training sums as prompts rendered by SmolLM2's chat template, and the
held-out split's 200 sums apart from them."""

from __future__ import annotations

import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_bench_job_names_a_real_model_and_a_real_taskset(smollm2, monkeypatch, tmp_path):
    monkeypatch.setenv("RLRUN_CACHE", str(smollm2["cache"]))
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    monkeypatch.syspath_prepend(str(REPO / "tests" / "docs"))
    import real_env
    from doc_env import dry_run

    settings = types.SimpleNamespace(samples=8, prompts=6, max_new=16, temperature=0.5, lr=2e-5, steps=25)
    argv = real_env.job(settings, str(smollm2["gguf"]), tmp_path / "run")
    code, out = dry_run("rlrun.ppo", argv, env={"PYTHONPATH": "examples/tasksets"})
    assert code == 0, out[-3000:]
    assert "--env_id sums_taskset: 1400 prompts (0 truncated, 0 dropped" in out
    assert "<|im_start|>user\\nWhat is 35 + 33? Answer with the number only.<|im_end|>" in out
    assert "reward: the rubric of the verifiers taskset --env_id sums_taskset" in out
    assert "policy: 134.52M parameters (30 layers" in out
    held_out = {(q, a) for q, a in real_env.held_out(200)}
    assert len(held_out) == 200 and ("What is 35 + 33? Answer with the number only.", 68) not in held_out
    sys.modules.pop("real_env", None)
