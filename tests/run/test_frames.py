"""The RL step reads top to bottom (issue 45): from the entry module to `optimizer.step` a newcomer passes at most
6 rlrun frames, the step's file among them. Measured as the issue measured it: a global optimizer step pre-hook
records the stack of a real 1-step demo run (one process), in a subprocess so that the run's process-group init
and teardown stay out of pytest's."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO, subprocess_env

SCRIPT = """
import os, sys, traceback
from torch.optim.optimizer import register_optimizer_step_pre_hook
import rlrun, rlrun.ppo
root = os.path.dirname(rlrun.__file__)
chains = []
register_optimizer_step_pre_hook(lambda opt, args, kwargs: chains.append(
    [f"{os.path.relpath(f.filename, root)}:{f.name}" for f in traceback.extract_stack() if f.filename.startswith(root)]))
rc = rlrun.ppo.main(["--config", sys.argv[1], "--max_steps", "1", "--save_path", sys.argv[2]])
print("RC", rc)
for chain in chains:
    print("CHAIN", " -> ".join(chain))
"""


def test_entry_to_optimizer_step_is_at_most_six_rlrun_frames(tmp_path):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO / "configs" / "demo.yaml"), str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=240, env=subprocess_env(), cwd=REPO)
    assert "RC 0" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    chains = [line.removeprefix("CHAIN ").split(" -> ") for line in out.stdout.splitlines() if line.startswith("CHAIN")]
    assert chains, "the demo's step called no optimizer"
    for chain in chains:  # the actor's optimizer step; the demo has no critic
        assert chain[0] == "ppo.py:main" and chain[-1] == "strategies/base.py:clip_and_step", chain
        assert len(chain) <= 6, chain
        assert "rl/trainer.py:train_step" in chain, chain
