"""bench/real_model.py as a smoke test: two GRPO steps of the real SmolLM2-135M-Instruct (its GGUF file, through
`actor_rollout_ref.model.path=FILE.gguf`) on GSM8K's verl parquet with the GSM8K format reward, and the held-out
greedy accuracy before and after, on the session's dequantised folder (the smollm2 fixture's RLRUN_CACHE)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import subprocess_env

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(900)
def test_two_grpo_steps_of_a_pretrained_model(smollm2, tmp_path):
    result = tmp_path / "real_model.json"
    cmd = [sys.executable, str(REPO / "bench" / "real_model.py"), "--steps", "2", "--prompts", "2", "--samples", "2",
           "--max_new", "16", "--eval", "2", "--workdir", str(tmp_path / "work"), "--json", str(result)]
    env = subprocess_env(RLRUN_CACHE=str(smollm2["cache"]), OMP_NUM_THREADS="2")  # one process: both cores
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(result.read_text())
    assert len(out["reward"]["all"]) == 2 and all(0 <= r <= 1.1 for r in out["reward"]["all"])
    assert out["held_out_accuracy"]["questions"] == 2
    assert all(0 <= out["held_out_accuracy"][when][rule] <= 1 for when in ("before", "after")
               for rule in ("strict", "last_number"))
    assert all(0 < n <= 16 for n in out["response_length"])
    assert out["sample_after"].strip()  # the trained model still writes text
    saved = json.loads((tmp_path / "work" / "run" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["num_hidden_layers"] == 30
    # the bench and its run found the session's dequantised folder: still one folder for the file, the same one
    built = [p for p in (smollm2["cache"] / "gguf-v1").iterdir() if p.name.startswith("SmolLM2-135M-Instruct.Q4_1-")]
    assert built == [smollm2["folder"]]
