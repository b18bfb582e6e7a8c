"""A real demo run explains itself (issue 27 item 4): rank 0's start-up lines (layout, generation backend, reward,
outputs, config), its save path holding config.yaml, metrics.jsonl, summary.json and curves.png, the summary lines
at the end; `--config <save_path>/config.yaml` resolves to the same config, and `python -m rlrun.report` draws the
summary and curves again from the metrics."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from helpers import DEMO_3, REPO, subprocess_env
from rlrun.cli.parser import parse_args
from rlrun.plan.generation import choose_generation



@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_run_explains_itself(demo_3) -> None:
    pytest.importorskip("matplotlib")
    save, res = demo_3
    assert res.returncode == 0, res.output[-3000:]
    out = res.output
    info = re.findall(r"^\[rlrun [\d:]+ info\] (.*)$", out, re.M)
    assert info[0].startswith("64 prompts") and "generation backend native" in info[0]
    # the speed settings, each with why and the flag that changes it (CPU: the defaults are off; rlrun.plan.speed)
    assert info[1] == ("speed settings: fixed micro-batches of 8 rows to train, 16 to score (CPU default; by tokens: "
                       "--dynamic_batch); padded rows, each micro-batch cut to its longest (CPU default; packed: "
                       "--packing_samples); "
                       "log-probs over the vocabulary 1,024 positions at a time (--logits_chunk_size); native decode "
                       "steps run eagerly (CPU default)"), info[1]
    assert info[2] == "layout: 2 ranks (2 per node, launcher torchrun)"
    assert re.search(r"^rank \| node \| local \| roles\s+\| groups$", out, re.M)  # the table under it, once
    assert out.count("rank | node | local") == 1
    assert info[3].startswith("reward: the demo rule")
    assert info[4].startswith(f"outputs in {save}: the model (Hugging Face format), config.yaml, metrics.jsonl, "
                              "summary.json, curves.png; no checkpoints")
    assert info[5].startswith(f"config: {save / 'config.yaml'} (") and "rerun with python -m rlrun.ppo --config" in info[5]
    assert {"config.yaml", "metrics.jsonl", "summary.json", "curves.png", "model.safetensors"} <= {p.name for p in save.iterdir()}
    end = info[info.index(f"saved the policy (Hugging Face format) to {save}") + 1:]
    assert end[0].startswith("summary: 3 steps") and "generated tokens/s" in end[0]
    assert end[1].startswith("reward: first step ") and ", best " in end[1]
    assert end[2].startswith(f"saved: model {save}, config {save / 'config.yaml'}, metrics") and "curves.png" in end[2]
    summary = json.loads((save / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["run"]["outcome"] == "finished" and summary["run"]["wall_s"] > 0
    assert (save / "curves.png").read_bytes()[:4] == b"\x89PNG"

    # The rerun's config is the run's: the same once generation is resolved (auto -> native) for both.
    first = choose_generation(parse_args(DEMO_3 + ["--save_path", str(save)]).config, cuda=False).config
    again = choose_generation(parse_args(["--config", str(save / "config.yaml")]).config, cuda=False).config
    assert again == first

    # The report is drawn again from the metrics alone; the run's own facts stay. (In the shared run's folder: the
    # summary names where it lies, and the other tests read the run's result, not its files.)
    (save / "summary.json").rename(save / "summary.before.json")
    (save / "curves.png").unlink()
    (save / "summary.json").write_text(json.dumps({"run": summary["run"]}))
    proc = subprocess.run([sys.executable, "-m", "rlrun.report", str(save)], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (save / "curves.png").exists()
    before = json.loads((save / "summary.before.json").read_text())
    assert json.loads((save / "summary.json").read_text()) == before
