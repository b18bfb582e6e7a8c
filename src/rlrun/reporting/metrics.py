"""Metric sinks on rank 0: JSONL file, progress (bar or lines), wandb, TensorBoard; and, when the sink closes, the
run's summary and curves beside the JSONL file (rlrun.reporting.run_report).

Evaluation results are separate records with the step they were taken at ({"step": N, "eval/...": ...}); step 0
is the evaluation before training."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from tqdm import tqdm

from rlrun.config.checkpoint import SavingConfig
from rlrun.config.tracking import TrackingConfig
from rlrun.reporting.run_report import metrics_path, write_report
from rlrun.reporting.summary import format_duration
from rlrun.runtime.errors import ConfigError, MissingExtraError
from rlrun.runtime.log import RankLogger, is_terminal
from rlrun.runtime.secrets import MASK, redact_text

# ---- progress ----------------------------------------------------------------------------------------------------
# Progress on rank 0: a tqdm bar on a terminal, one readable line per logged step anywhere else.
#
# Under Slurm or with redirected output a tqdm bar becomes one endless carriage-return line, so when stdout or
# stderr is not a terminal every logged step prints a line like
# ``[rlrun 12:01:02 info] step 12/200 | reward 0.412 | kl 0.0031 | len 87.2 | 3.41 s/step | ETA 10m48s``.
# RLRUN_NO_PROGRESS=1 turns the bar off (the lines stay: they are plain log output).

# (metric key, short name, format) shown on the bar and in each line, when present.
SHOWN = (
    ("reward", "reward", ".3f"),
    ("kl", "kl", ".4g"),
    ("response_length", "len", ".1f"),
    ("actor/policy_loss", "policy_loss", ".4g"),
    ("perf/mfu/actor", "MFU", ".1%"),
    ("critic/value_loss", "value_loss", ".4g"),
    ("loss", "loss", ".4f"),
    ("acc", "acc", ".3f"),
    ("margin", "margin", ".3f"),
)


def format_eval(evals: Mapping[str, Any]) -> str:
    """'eval reward 0.500 pass@4 0.750 len 12.0' (PPO) or 'eval loss 0.6930 acc 0.500' (rlrun.sft/rm/dpo) from the
    eval/ metrics (other eval/ keys stay in the sinks)."""
    parts = []
    if "eval/reward" in evals:
        parts.append(f"reward {evals['eval/reward']:.3f}")
    parts += [f"{key.removeprefix('eval/')} {evals[key]:.3f}" for key in sorted(evals) if key.startswith("eval/pass@")]
    parts += [
        f"{name} {evals[f'eval/{name}']:{fmt}}"
        for name, fmt in (("loss", ".4f"), ("acc", ".3f"))
        if f"eval/{name}" in evals
    ]  # rlrun.sft/rm/dpo's
    if "eval/response_length" in evals:
        parts.append(f"len {evals['eval/response_length']:.1f}")
    return "eval " + " ".join(parts)


def format_step_line(
    step: int,
    total: int,
    metrics: Mapping[str, Any],
    seconds_per_step: float | None,
    evals: Mapping[str, Any] | None = None,
) -> str:
    """The text of one step's line (without the '[rlrun time info]' prefix)."""
    parts = [f"step {step}/{total}"]
    parts += [f"{name} {metrics[key]:{fmt}}" for key, name, fmt in SHOWN if isinstance(metrics.get(key), (int, float))]
    if seconds_per_step is not None:
        parts.append(f"{seconds_per_step:.2f} s/step")
        parts.append(f"ETA {format_duration(seconds_per_step * max(0, total - step))}")
    if evals:
        parts.append(format_eval(evals))
    return " | ".join(parts)


class LineProgress:
    """One line per logged step on `stream` (stdout), timed from the first step of this run."""

    def __init__(
        self,
        total: int,
        start_step: int,
        stream: TextIO,
        clock: Callable[[], float] = time.monotonic,
        stamp: Callable[[], str] = lambda: time.strftime("%H:%M:%S"),
    ) -> None:
        self.total, self.start_step, self.stream = total, start_step, stream
        self.clock, self.stamp = clock, stamp
        self.started = clock()

    def _print(self, text: str) -> None:
        print(f"[rlrun {self.stamp()} info] {text}", file=self.stream, flush=True)

    def step(self, step: int, metrics: Mapping[str, Any], evals: Mapping[str, Any] | None = None) -> None:
        done = step - self.start_step
        # The mean over this run's steps (evaluation included): steadier than the last step, and honest for the ETA.
        per_step = (self.clock() - self.started) / done if done > 0 else None
        self._print(format_step_line(step, self.total, metrics, per_step, evals))

    def eval(self, step: int, evals: Mapping[str, Any]) -> None:
        self._print(f"{format_eval(evals)} (at step {step}/{self.total})")

    def close(self) -> None:
        pass


class BarProgress:
    """The tqdm bar on a terminal; evaluation results print above it."""

    def __init__(self, total: int, start_step: int, enabled: bool) -> None:
        self.bar = tqdm(total=total, initial=start_step, desc="rlrun", dynamic_ncols=True, disable=not enabled)

    def step(self, step: int, metrics: Mapping[str, Any], evals: Mapping[str, Any] | None = None) -> None:
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix({name: f"{metrics[key]:.3g}" for key, name, _ in SHOWN if key in metrics})
        if evals:
            self.eval(step, evals)

    def eval(self, step: int, evals: Mapping[str, Any]) -> None:
        if not self.bar.disable:
            self.bar.write(f"{format_eval(evals)} (at step {step})")

    def close(self) -> None:
        self.bar.close()


def make_progress(
    total: int,
    start_step: int,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> LineProgress | BarProgress:
    """A bar when both stdout and stderr are terminals (the bar draws on stderr), else lines on stdout."""
    out, err = stdout or sys.stdout, stderr or sys.stderr
    env = os.environ if environ is None else environ
    if is_terminal(out) and is_terminal(err):
        return BarProgress(total, start_step, enabled=env.get("RLRUN_NO_PROGRESS") != "1")
    return LineProgress(total, start_step, out)


class MetricsSink:
    def __init__(
        self,
        logging: TrackingConfig,
        saving: SavingConfig,
        total_steps: int,
        start_step: int,
        trainer: str = "ppo",
        config: dict[str, Any] | None = None,
    ) -> None:
        """`config`: the run's settings, redacted (rlrun.config.fields.redacted), for the trackers."""
        path = metrics_path(logging, saving)
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
            raise ConfigError(
                f"cannot write the metrics file {path}: {exc.strerror}; check --save_path/--metrics_file"
            ) from None
        self.path = path
        self.progress = make_progress(total_steps, start_step)
        self.wandb = _init_wandb(logging, trainer, config or {}) if logging.use_wandb is not None else None
        self.tb = _init_tensorboard(logging.use_tensorboard) if logging.use_tensorboard else None
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

    def finish(self, log: RankLogger, saved: Mapping[str, str], wall_s: float, outcome: str = "finished") -> None:
        """The end of a run that did not fail (`outcome`: "finished", or "preempted": stopped with a checkpoint on
        a notice): close, then write and print the run's summary and curves (`saved`: {what: path} of the trainer's
        outputs; `wall_s`: the run's time from start-up). A report that cannot be written is one warning line,
        never a failed run."""
        self.close(report=False)
        try:
            lines, why = write_report(self.path, {"outcome": outcome, "wall_s": wall_s, "saved": dict(saved)})
        except Exception as exc:  # noqa: BLE001 - the training is done and saved; the report is a bonus
            log.warning_once(f"no run summary written beside {self.path}: {type(exc).__name__}: {exc}")
            return
        for line in lines:
            log.info_once(line)
        if why is not None:
            log.warning_once(
                f"no curves plotted: {why}; the summary is written (python -m rlrun.report "
                f"{os.path.dirname(self.path) or '.'} draws them later)"
            )

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


def _init_wandb(lg: TrackingConfig, trainer: str, config: dict[str, Any]) -> Any:
    try:
        import wandb  # noqa: PLC0415 - optional extra (rlrun[wandb])
    except ImportError:
        raise MissingExtraError("wandb", "wandb", "--use_wandb") from None
    key = lg.use_wandb or os.environ.get("WANDB_API_KEY")
    if key and os.environ.get("WANDB_MODE") not in ("offline", "disabled"):
        wandb.login(key=key, relogin=True)
    # wandb records sys.argv in the run's metadata (uploaded on sync); a key passed as --use_wandb KEY must not be in
    # it.
    saved_argv = sys.argv
    sys.argv = [redact_text(_scrub(arg, [key] if key else [])) for arg in saved_argv]
    try:
        return wandb.init(
            entity=lg.wandb_org,
            project=lg.wandb_project or f"rlrun_{trainer}",
            group=lg.wandb_group,
            name=lg.wandb_run_name,
            config=config,
            reinit=True,
        )
    finally:
        sys.argv = saved_argv


def _scrub(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, MASK)
    return text


def _init_tensorboard(log_dir: str) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional extra (rlrun[tensorboard])
    except ImportError:
        raise MissingExtraError("tensorboard", "tensorboard", "--use_tensorboard") from None
    return SummaryWriter(log_dir=log_dir)
