"""Every policy loss of verl's registry and every kind of rollout correction learns on the demo (GRPO, one rank,
the native engine, which reports the sampled tokens' log-probs): two interpreters side by side run them all
(tests/rl/algorithm_runs.py), each for 24 steps, most runs a loss and a correction together. On one rank the engine and the actor compute the same
probabilities, so the corrections' weights are ~1 here; tests/rl/test_async_train.py runs one against a real one-step
mismatch, and tests/algo/test_rollout_correction.py checks their numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, subprocess_env

STEPS = 24
# Each run proves a loss and a correction at once: every loss of verl's registry, and every kind of correction
# (token / sequence TIS, IcePop, the three rejection kinds, OpenRLHF's gate, both bypass losses).
LOSSES: dict[str, list[str]] = {
    "cispo": ["--policy_loss_type", "cispo", "--eps_clip_low_high", "10", "0.2"],  # verl's example: no lower clip
    "sapo": ["--policy_loss_type", "sapo"],
    "gpg": ["--policy_loss_type", "gpg"],
    "clip_cov": ["--policy_loss_type", "clip_cov", "--clip_cov_ratio", "0.02"],
    "kl_cov": ["--policy_loss_type", "kl_cov", "--kl_cov_ratio", "0.02"],
    "geo_mean": ["--policy_loss_type", "geo_mean", "--eps_clip_low_high", "0.4", "0.4"],
    "dppo_tv": ["--policy_loss_type", "dppo_tv", "--eps_clip_low_high", "0.15", "0.15"],
    "dppo_kl": ["--policy_loss_type", "dppo_kl", "--eps_clip_low_high", "0.05", "0.05"],
    "dro": ["--policy_loss_type", "dro", "--dro_beta", "0.05"],
    "bypass_pg": [],  # the correction sets the loss: verl's bypass "reinforce", rlrun's gpg with the weights
}
CORRECTIONS: dict[str, list[str]] = {
    "cispo": ["--rollout_correction", "decoupled_token_is"],
    "sapo": ["--rollout_correction", "decoupled_seq_is_rs"],
    "gpg": ["--rollout_correction", "decoupled_token_icepop"],
    "clip_cov": ["--rollout_correction", "decoupled_geo_rs_token_tis"],
    "kl_cov": ["--rollout_correction", "decoupled_k3_rs"],
    "geo_mean": ["--enable_vllm_is_correction", "--vllm_is_correction_type", "seq-mask-tis"],
    "dppo_tv": ["--rollout_correction", "bypass_ppo_clip"],
    "bypass_pg": ["--rollout_correction", "bypass_pg_is"],
}
RUNS = {name: [*flags, *CORRECTIONS.get(name, [])] for name, flags in LOSSES.items()}
WEIGHTED = ("cispo", "sapo", "gpg", "clip_cov", "geo_mean")  # decoupled corrections with importance weights
REJECTING = ("sapo", "clip_cov", "kl_cov")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every run, in two interpreters side by side: each run is one rank on one thread (OMP_NUM_THREADS=1), so two
    halves use the machine's two cores (each run is seeded by its own command line wherever it runs)."""
    out = tmp_path_factory.mktemp("algorithms")
    names = sorted(RUNS)
    procs = []
    for half in (names[::2], names[1::2]):
        spec = out / f"spec_{half[0]}.json"
        spec.write_text(json.dumps({name: [*RUNS[name], "--max_steps", str(STEPS)] for name in half}))
        procs.append(subprocess.Popen([sys.executable, str(REPO / "tests" / "rl" / "algorithm_runs.py"), str(spec),
                                       str(out)], cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [proc.communicate(timeout=400)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()  # a no-op for a finished one; never leave a half running after a timeout
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
    return out


def _metrics(runs: Path, name: str) -> list[dict]:
    assert not (runs / name / "failed").exists(), (runs / name / "failed").read_text()
    return [json.loads(line) for line in (runs / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_learns_on_the_demo(runs: Path, name: str) -> None:
    rows = _metrics(runs, name)
    assert len(rows) == STEPS
    rewards = [r["reward"] for r in rows]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-4:]) / 4
    assert last > first + 0.15, [round(r, 3) for r in rewards]
    stats = rows[-1]
    if name in ("clip_cov", "kl_cov"):  # the covariance selection acted
        key = "actor/cov_detached_frac" if name == "clip_cov" else "actor/cov_penalised_frac"
        assert any(r[key] > 0 for r in rows)
    bypass = "bypass" in " ".join(RUNS[name])
    if name in CORRECTIONS:
        # one-rank engine and actor agree: the mismatch is float noise, and the weights ~1; bypass mode computes it
        # per micro-batch against the current policy (a step's second mini-batch has moved), and the actor logs it
        kl = stats["actor/rollout_corr/kl" if bypass else "rollout_corr/kl"]
        assert abs(kl) < (2e-2 if bypass else 1e-4), stats
        assert bypass == ("rollout_corr/kl" not in stats)
    if name in WEIGHTED:
        assert abs(stats["rollout_corr/rollout_is_mean"] - 1) < 1e-3
    if name in REJECTING:
        assert "rollout_corr/rollout_rs_masked_fraction" in stats
