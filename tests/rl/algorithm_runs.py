"""Runs several one-rank demo jobs one after the other in this one process (rlrun.ppo.main, the embedded tiny model,
the native engine): `python algorithm_runs.py SPEC.json OUTDIR`, SPEC mapping a run's name to its extra flags. Each
run writes OUTDIR/NAME/metrics.jsonl; a run that fails writes OUTDIR/NAME/failed with its exit code. One interpreter
for all of them: each run costs its training steps, not another torch import (tests/rl/test_algorithms_e2e.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import rlrun.ppo

BASE = ["--config", "configs/demo.yaml", "--generation_backend", "native"]

if __name__ == "__main__":
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    for name, flags in spec.items():
        save = out / name
        code = rlrun.ppo.main([*BASE, *flags, "--save_path", str(save)])
        if code:
            save.mkdir(parents=True, exist_ok=True)
            (save / "failed").write_text(str(code))
