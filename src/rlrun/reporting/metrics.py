"""Metric sinks on rank 0: JSONL file, progress (bar or lines), wandb, TensorBoard; and, when the sink closes, the
run's summary and curves beside the JSONL file (rlrun.reporting.run_report).

Evaluation results are separate records with the step they were taken at ({"step": N, "eval/...": ...}); step 0
is the evaluation before training."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

from rlrun.config.fields import redacted
from rlrun.config.schema import RootConfig
from rlrun.reporting.progress import make_progress
from rlrun.reporting.run_report import metrics_path, write_report
from rlrun.runtime.errors import ConfigError, MissingExtraError
from rlrun.runtime.log import RankLogger
from rlrun.runtime.secrets import MASK, redact_text


class MetricsSink:
    def __init__(self, cfg: RootConfig, total_steps: int, start_step: int, trainer: str = "ppo") -> None:
        path = metrics_path(cfg)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            kept = _lines_up_to(path, start_step) if start_step > 0 else []
            # A resumed run keeps the lines of the steps it does not redo; a fresh run starts empty.
            # Replace-then-append: a kill at any moment leaves the old or the new file, never neither.
            tmp = f"{path}.tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.writelines(kept)
            os.replace(tmp, path)
            self.file = open(path, "a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot write the metrics file {path}: {exc.strerror}; check --save_path/--metrics_file") from None
        self.path = path
        self.progress = make_progress(total_steps, start_step)
        self.wandb = _init_wandb(cfg, trainer) if cfg.logging.use_wandb is not None else None
        self.tb = _init_tensorboard(cfg.logging.use_tensorboard) if cfg.logging.use_tensorboard else None
        self.closed = False

    def log(self, metrics: dict[str, Any], evals: dict[str, float] | None = None) -> None:
        """One training step's record (and, when given, that step's evaluation record)."""
        step = int(metrics["step"])
        self._write(metrics)
        if evals:
            self._write({"step": step, **evals})
        self.progress.step(step, metrics, evals)

    def log_eval(self, step: int, evals: dict[str, float]) -> None:
        """An evaluation at a step that logs no training record (step 0, or between logging steps)."""
        self._write({"step": step, **evals})
        self.progress.eval(step, evals)

    def _write(self, metrics: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        step = int(metrics["step"])
        numeric = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
        if self.wandb is not None:
            self.wandb.log(numeric, step=step)
        if self.tb is not None:
            for k, v in numeric.items():
                self.tb.add_scalar(k, v, step)

    def finish(self, log: RankLogger, saved: Mapping[str, str], wall_s: float) -> None:
        """The normal end: close, then write and print the run's summary and curves (`saved`: {what: path} of
        the trainer's outputs; `wall_s`: the run's time from start-up). A report that cannot be written is one
        warning line, never a failed run."""
        self.close(report=False)
        try:
            lines, why = write_report(self.path, {"outcome": "finished", "wall_s": wall_s, "saved": dict(saved)})
        except Exception as exc:  # noqa: BLE001 - the training is done and saved; the report is a bonus
            log.warning_once(f"no run summary written beside {self.path}: {type(exc).__name__}: {exc}")
            return
        for line in lines:
            log.info_once(line)
        if why is not None:
            log.warning_once(f"no curves plotted: {why}; the summary is written (python -m rlrun.report "
                             f"{os.path.dirname(self.path) or '.'} draws them later)")

    def close(self, report: bool = True) -> None:
        """Close every sink. `report`: after a run that stopped early (the failure path closes the sink), also
        write its summary and curves so far, quietly and only if that works."""
        if self.closed:
            return
        self.closed = True
        self.progress.close()
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tb is not None:
            self.tb.close()
        if report:
            try:
                write_report(self.path, {"outcome": "stopped before the end"})
            except Exception:  # noqa: BLE001 - a failing run is already reporting its own error
                pass


def _lines_up_to(path: str, step: int) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        lines = fh.readlines()
    keep = []
    for line in lines:
        try:
            if int(json.loads(line)["step"]) <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash
    return keep


def _init_wandb(cfg: RootConfig, trainer: str) -> Any:
    try:
        import wandb
    except ImportError:
        raise MissingExtraError("wandb", "wandb", "--use_wandb") from None
    key = cfg.logging.use_wandb or os.environ.get("WANDB_API_KEY")
    if key and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        wandb.login(key=key, relogin=True)
    # wandb records sys.argv in the run's metadata (uploaded on sync); a key passed as --use_wandb KEY must not be in it.
    saved_argv = sys.argv
    sys.argv = [redact_text(_scrub(arg, [key] if key else [])) for arg in saved_argv]
    try:
        return wandb.init(entity=cfg.logging.wandb_org, project=cfg.logging.wandb_project or f"rlrun_{trainer}",
                          group=cfg.logging.wandb_group, name=cfg.logging.wandb_run_name, config=redacted(cfg),
                          reinit=True)
    finally:
        sys.argv = saved_argv


def _scrub(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, MASK)
    return text


def _init_tensorboard(log_dir: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise MissingExtraError("tensorboard", "tensorboard", "--use_tensorboard") from None
    return SummaryWriter(log_dir=log_dir)
