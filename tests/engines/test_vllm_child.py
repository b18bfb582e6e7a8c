"""The vLLM child engine on its own (lane venv): weight syncs (streamed through the staging buffers' shared memory),
greedy parity with HF, log-probs, per-request seeds (--vllm_seeded_requests) against one seed per call."""

from __future__ import annotations

import json
import subprocess

import pytest

from vllm_lane import LANE_PYTHON, REPO, lane_env, needs_lane

pytestmark = [needs_lane, pytest.mark.slow]


def _lane_report(script: str) -> dict:
    """Run tests/engines/SCRIPT under the lane's python; its RESULT line."""
    proc = subprocess.run([str(LANE_PYTHON), str(REPO / "tests/engines" / script)], cwd=REPO,
                          env=lane_env(), capture_output=True, text=True, timeout=420)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_child_engine_matches_hf_after_each_weight_sync():
    report = _lane_report("vllm_weights_check.py")
    checks = report["checks"]
    # round 0: the initial weights; 1: updated in place; 2: the actor's parameters in new memory. Each sync streams
    # through the two staging buffers, several buckets, and the engine's rank keeps no copy of the policy
    assert [c["round"] for c in checks] == [0, 1, 2]
    assert report["buckets"] > 2 and report["engine_on_meta"], report
    for c in checks:
        assert c["greedy_equal"], c  # vLLM greedy == HF greedy on the same (synced) weights
        assert c["max_logprob_diff"] < 1e-4, c  # sampled-token log-probs == HF teacher forcing
        assert c["lengths_match"] and c["repeat_same_samples"], c
    # the weights really changed between rounds (else parity would prove nothing)
    assert checks[0]["greedy_first"] != checks[1]["greedy_first"] != checks[2]["greedy_first"]
    stop = report["stop"]  # multi-turn: per-call cap and stop strings end a row at the completing token
    assert stop["found_in_row0"] and stop["max_len"] <= 10 and stop["rows_as_rule"] and stop["lengths_match"], stop
    seeded = report["seeded"]
    # --vllm_seeded_requests: a row alone or in a reversed batch samples the same; without: one seed per call,
    # repeatable (the sampler is seeded for the call), and rows sampled alone come out otherwise
    assert seeded["solo_equal"] and seeded["reversed_equal"] and seeded["unseeded_repeat_equal"], seeded
    assert seeded["unseeded_solo_rows_equal"] < 8, seeded
    assert report["child_exitcode"] == 0  # stop() ends the child cleanly


def test_child_engine_runs_a_lora_policys_adapters_loaded_by_name_each_sync():
    """Adapter-only LoRA sync on vLLM (engines/vllm/lora.py): the base weights are read at start, each sync's adapters
    are loaded under a new name and checked on arrival; vLLM samples as HF does on the PEFT model."""
    report = _lane_report("vllm_lora_check.py")
    checks = report["checks"]
    assert report["engine_on_meta"], report  # the rank keeps no copy of the base weights once vLLM read them
    for i, c in enumerate(checks):
        # vLLM adds the adapters' product in its own LoRA kernels, in another order than PEFT: 8.6e-6 at most here
        # (adapters that did not arrive are off by 1e-1 or more)
        assert c["greedy_equal"] and c["max_logprob_diff"] < 1e-4, c
        assert c["version"] == f"rlrun-policy-v{i + 1}" and c["versions_on_disk"] == [f"v{i + 1}"], c
    # round 0: B is zero, so the policy is the base; then the trained adapters make vLLM's answers differ from it
    assert checks[0]["base_greedy_equal"] and not checks[1]["base_greedy_equal"], checks
    # a version whose file differs from what the sync sent is refused on arrival, naming it and both sums
    assert "rlrun-policy-v4 did not arrive whole in vLLM" in (report["corrupt_error"] or ""), report
