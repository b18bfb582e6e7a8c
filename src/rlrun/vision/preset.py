"""`--model_preset tiny-vl`: the offline VLM demo's model and data, built on first use into rlrun's cache and read
from there like any saved model (`--pretrain`) and data file (`--prompt_data`), so the same code path runs the demo
and a user's own VLM. Every rank may build at once: each writes a private folder and renames it into place (the
first rename wins; the folders are identical for the same seed)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable

from rlrun.config.schema import Config
from rlrun.vision.demo_data import write_colour_task

PRESET = "tiny-vl"
VERSION = 2  # bump when the model or the task changes: older cache folders are then not reused


def cache_root() -> str:
    """RLRUN_CACHE, else ~/.cache/rlrun."""
    return os.environ.get("RLRUN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "rlrun")


def _built(final: str, build: Callable[[str], object]) -> str:
    if os.path.isdir(final):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    scratch = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(final))
    try:
        build(scratch)
        try:
            os.rename(scratch, final)
        except OSError:
            if not os.path.isdir(final):  # not another rank's finished folder: a real failure
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


def resolve_vl_preset(cfg: Config) -> Config:
    """`cfg` with --model_preset tiny-vl turned into --pretrain (the tiny Qwen2.5-VL for --seed) and, without
    --prompt_data, the colour task in OpenRLHF-M's layout (--input_key message --label_key answer)."""
    m, d = cfg.model, cfg.data
    if m.model_preset != PRESET or m.pretrain is not None:
        return cfg
    root = os.path.join(cache_root(), f"{PRESET}-v{VERSION}")
    seed = cfg.train.seed
    from rlrun.vision.tiny import save_tiny_vl  # noqa: PLC0415 - imports transformers (seconds), only for this preset

    model = _built(os.path.join(root, f"model-seed{seed}"), lambda path: save_tiny_vl(path, seed=seed))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(m, pretrain=model))
    if d.prompt_data is None:
        data = _built(os.path.join(root, "colour_task"), lambda path: write_colour_task(path, records=32, absolute=False))
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(d, prompt_data=os.path.join(data, "colour_task.jsonl")))
    return cfg
