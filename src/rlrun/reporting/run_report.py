"""A run that explains itself, on rank 0: at start-up where everything goes (and config.yaml written into the
save path), at the end the summary and the curves beside the metrics file (rlrun.reporting.summary, .curves).
Every trainer calls the same functions; ``python -m rlrun.report RUN_DIR`` calls `write_report` too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rlrun.cli.run_config import CONFIG_FILE
from rlrun.config.checkpoint import SavingConfig
from rlrun.config.model import PretrainedConfig
from rlrun.config.tracking import TrackingConfig
from rlrun.reporting.summary import format_summary, outputs_beside, plot_curves, read_metrics, summarize, write_summary


def metrics_path(logging: TrackingConfig, saving: SavingConfig) -> str:
    """Where the metrics JSONL goes: --metrics_file, else <save_path>/metrics.jsonl."""
    return logging.metrics_file or os.path.join(saving.save_path, "metrics.jsonl")


def model_form(model: PretrainedConfig, saving: SavingConfig) -> str:
    """How --save_path receives the model: HF format, or with LoRA PEFT's adapter layout (rlrun.roles.export)."""
    if model.lora_rank <= 0:
        return "(Hugging Face format)"
    merged = f"; merged in {os.path.join(saving.save_path, 'merged')}" if saving.save_merged else ""
    return f"as a LoRA adapter (PEFT format{merged})"


def announce(
    model: PretrainedConfig, saving: SavingConfig, logging: TrackingConfig, prog: str, config: str, count: int
) -> list[str]:
    """The start-up lines saying where the model, metrics, summary, curves, checkpoints and `config` (the run's
    config.yaml, holding `count` settings: rlrun.cli.run_config) go."""
    save = saving.save_path
    metrics = metrics_path(logging, saving)
    summary, curves = outputs_beside(metrics)
    reports = ", ".join(os.path.basename(p) for p in (metrics, summary, curves))
    name = os.path.basename(config)
    if os.path.abspath(os.path.dirname(metrics)) == os.path.abspath(save):
        where = f"outputs in {save}: the model {model_form(model, saving)}, {name}, {reports}"
    else:
        where = (
            f"outputs: the model {model_form(model, saving)} and {name} in {save}; {reports} in "
            f"{os.path.dirname(metrics)}"
        )
    every = saving.save_steps
    where += (
        f"; checkpoints every {every} steps in {saving.ckpt_path}"
        if every > 0 and saving.ckpt_path
        else "; no checkpoints (--save_steps -1) but one a preemption notice asks for"
    )
    trackers = [f"TensorBoard {logging.use_tensorboard}"] if logging.use_tensorboard else []
    trackers += (
        [f"wandb project {logging.wandb_project or 'rlrun_' + prog.split('.')[-1]}"]
        if logging.use_wandb is not None
        else []
    )
    return [
        where + (f"; also to {', '.join(trackers)}" if trackers else ""),
        f"config: {config} ({count} settings differ from the defaults; rerun with {prog} --config {config})",
    ]


def describe_roles(ranks_by_role: Mapping[str, Sequence[int]]) -> str:
    """'actor ranks 0-3, ref 0-3, engine 4-7': a layout too large for its per-rank table, in one line."""
    return ", ".join(
        f"{role} {'ranks ' if i == 0 else ''}{_ranges(ranks)}" for i, (role, ranks) in enumerate(ranks_by_role.items())
    )


def _ranges(ranks: Sequence[int]) -> str:
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and runs[-1][1] == rank - 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def write_report(metrics: str, run: Mapping[str, Any] | None = None, title: str = "") -> tuple[list[str], str | None]:
    """summary.json and curves.png beside the metrics file `metrics`; (the summary lines, why no PNG was drawn or
    None). `run`: what only the run knows (wall_s, outcome, saved: {what: path}); None keeps a previous summary's."""
    records = read_metrics(metrics)
    summary_path, png = outputs_beside(metrics)
    if run is None:
        run = _previous_run(summary_path)
    why = plot_curves(records, png, title or os.path.basename(os.path.dirname(os.path.abspath(metrics))))
    summary = summarize(records, metrics)
    saved = {**dict(run.get("saved") or {}), "metrics": metrics, "summary": summary_path}
    if why is None:
        saved["curves"] = png
    else:
        saved.pop("curves", None)
    summary["run"] = {**run, "saved": saved}
    write_summary(summary, summary_path)
    return format_summary(summary), why


def _previous_run(summary_path: str) -> dict[str, Any]:
    try:
        with open(summary_path, encoding="utf-8") as fh:
            previous = json.load(fh).get("run")
    except (OSError, ValueError, AttributeError):
        return {}
    return previous if isinstance(previous, dict) else {}


def saved_outputs(model: PretrainedConfig, saving: SavingConfig, **more: str) -> dict[str, str]:
    """{what: path} a finished run saved: the model, `more` (e.g. critic=...), checkpoints, config.yaml."""
    save = saving.save_path
    if model.lora_rank > 0 and saving.save_merged:
        more = {"merged model": os.path.join(save, "merged"), **more}
    return {
        "model": save,
        **more,
        **({"checkpoints": saving.ckpt_path} if saving.ckpt_path and saving.save_steps > 0 else {}),
        "config": os.path.join(save, CONFIG_FILE),
    }


def pure_distillation_line(teacher: str | None) -> str:
    """Where the rewards come from when the policy learns from the teacher alone (Config.scores_nothing)."""
    return f"reward: none; the policy learns from the teacher --teacher_pretrain {teacher} alone"
