"""A run that explains itself, on rank 0: at start-up where everything goes (and config.yaml written into the
save path), at the end the summary and the curves beside the metrics file (rlrun.reporting.summary, .curves).
Every trainer calls the same functions; ``python -m rlrun.report RUN_DIR`` calls `write_report` too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rlrun.config.schema import Config, RootConfig
from rlrun.reporting.curves import plot_curves
from rlrun.reporting.run_config import CONFIG_FILE, write_run_config
from rlrun.reporting.summary import format_summary, outputs_beside, read_metrics, summarize, write_summary
from rlrun.runtime.secrets import redact_text


def metrics_path(cfg: RootConfig) -> str:
    """Where the metrics JSONL goes: --metrics_file, else <save_path>/metrics.jsonl."""
    return cfg.logging.metrics_file or os.path.join(cfg.checkpoint.save_path, "metrics.jsonl")


def model_form(cfg: RootConfig) -> str:
    """How --save_path receives the model: HF format, or with LoRA PEFT's adapter layout (rlrun.roles.export)."""
    if cfg.model.lora_rank <= 0:
        return "(Hugging Face format)"
    merged = f"; merged in {os.path.join(cfg.checkpoint.save_path, 'merged')}" if cfg.checkpoint.save_merged else ""
    return f"as a LoRA adapter (PEFT format{merged})"


def announce(cfg: RootConfig, defaults: Mapping[str, Any], prog: str, launched: str, ckpt_path: str | None) -> list[str]:
    """Write config.yaml into the save path; the start-up lines saying where the model, metrics, summary, curves,
    checkpoints and config go. `ckpt_path`: the trainer's checkpoint folder."""
    save = cfg.checkpoint.save_path
    config, count = write_run_config(cfg, defaults, save, prog, launched)
    metrics = metrics_path(cfg)
    summary, curves = outputs_beside(metrics)
    reports = ", ".join(os.path.basename(p) for p in (metrics, summary, curves))
    if os.path.abspath(os.path.dirname(metrics)) == os.path.abspath(save):
        where = f"outputs in {save}: the model {model_form(cfg)}, {CONFIG_FILE}, {reports}"
    else:
        where = (f"outputs: the model {model_form(cfg)} and {CONFIG_FILE} in {save}; {reports} in "
                 f"{os.path.dirname(metrics)}")
    every = cfg.checkpoint.save_steps
    where += (f"; checkpoints every {every} steps in {ckpt_path}" if every > 0 and ckpt_path
              else "; no checkpoints (--save_steps -1)")
    lg = cfg.logging
    trackers = [f"TensorBoard {lg.use_tensorboard}"] if lg.use_tensorboard else []
    trackers += [f"wandb project {lg.wandb_project or 'rlrun_' + prog.split('.')[-1]}"] if lg.use_wandb is not None else []
    return [where + (f"; also to {', '.join(trackers)}" if trackers else ""),
            f"config: {config} ({count} settings differ from the defaults; rerun with {prog} --config {config})"]


def describe_reward(cfg: Config) -> str:
    """Where a PPO run's rewards come from, in one line (URLs without credentials)."""
    m, ag = cfg.model, cfg.agent
    if cfg.needs_reward_model:
        return f"reward: the reward model --reward_pretrain {m.reward_pretrain}"
    if ag.agent_func_path is not None:
        return f"reward: the episodes of the agent --agent_func_path {ag.agent_func_path}"
    if ag.retriever_url is not None:
        return f"reward: the built-in Search-R1 agent's episodes (retriever {redact_text(ag.retriever_url)})"
    if m.compute_score == "builtin":
        return ("reward: rlrun's versions of verl's rule scores, chosen per prompt by its data source "
                "(--compute_score builtin)")
    if m.compute_score is not None:
        return f"reward: {m.compute_score_name}() of --compute_score {m.compute_score} (verl's convention), per sample"
    if m.remote_rm_url is None or m.remote_rm_url == "demo":
        return "reward: the demo rule (the fraction of response characters that are digits / letters, as asked)"
    kind = "reward_func() of" if m.remote_rm_url.endswith(".py") else "the HTTP endpoint"
    return f"reward: {kind} --remote_rm_url {redact_text(m.remote_rm_url)}"


def describe_roles(ranks_by_role: Mapping[str, Sequence[int]]) -> str:
    """'actor ranks 0-3, ref 0-3, engine 4-7': a layout too large for its per-rank table, in one line."""
    return ", ".join(f"{role} {'ranks ' if i == 0 else ''}{_ranges(ranks)}"
                     for i, (role, ranks) in enumerate(ranks_by_role.items()))


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


def saved_outputs(cfg: RootConfig, ckpt_path: str | None, **more: str) -> dict[str, str]:
    """{what: path} a finished run saved: the model, `more` (e.g. critic=...), checkpoints, config.yaml."""
    save = cfg.checkpoint.save_path
    if cfg.model.lora_rank > 0 and cfg.checkpoint.save_merged:
        more = {"merged model": os.path.join(save, "merged"), **more}
    return {"model": save, **more, **({"checkpoints": ckpt_path} if ckpt_path and cfg.checkpoint.save_steps > 0 else {}),
            "config": os.path.join(save, CONFIG_FILE)}
