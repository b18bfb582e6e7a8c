"""Progress on rank 0: a tqdm bar on a terminal, one readable line per logged step anywhere else.

Under Slurm or with redirected output a tqdm bar becomes one endless carriage-return line, so when stdout or
stderr is not a terminal every logged step prints a line like
``[rlrun 12:01:02 info] step 12/200 | reward 0.412 | kl 0.0031 | len 87.2 | 3.41 s/step | ETA 10m48s``.
RLRUN_NO_PROGRESS=1 turns the bar off (the lines stay: they are plain log output).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from tqdm import tqdm

from rlrun.runtime.log import is_terminal

# (metric key, short name, format) shown on the bar and in each line, when present.
SHOWN = (("reward", "reward", ".3f"), ("kl", "kl", ".4g"), ("response_length", "len", ".1f"),
         ("actor/policy_loss", "policy_loss", ".4g"), ("critic/value_loss", "value_loss", ".4g"),
         ("loss", "loss", ".4f"), ("acc", "acc", ".3f"), ("margin", "margin", ".3f"))


def format_duration(seconds: float) -> str:
    """3725 -> '1h02m05s', 648 -> '10m48s', 7.4 -> '7s'."""
    total = max(0, int(round(seconds)))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_eval(evals: Mapping[str, Any]) -> str:
    """'eval reward 0.500 pass@4 0.750 len 12.0' (PPO) or 'eval loss 0.6930 acc 0.500' (rlrun.sft/rm/dpo) from the
    eval/ metrics (other eval/ keys stay in the sinks)."""
    parts = []
    if "eval/reward" in evals:
        parts.append(f"reward {evals['eval/reward']:.3f}")
    parts += [f"{key.removeprefix('eval/')} {evals[key]:.3f}" for key in sorted(evals) if key.startswith("eval/pass@")]
    parts += [f"{name} {evals[f'eval/{name}']:{fmt}}" for name, fmt in (("loss", ".4f"), ("acc", ".3f"))
              if f"eval/{name}" in evals]  # rlrun.sft/rm/dpo's
    if "eval/response_length" in evals:
        parts.append(f"len {evals['eval/response_length']:.1f}")
    return "eval " + " ".join(parts)


def format_step_line(step: int, total: int, metrics: Mapping[str, Any], seconds_per_step: float | None,
                     evals: Mapping[str, Any] | None = None) -> str:
    """The text of one step's line (without the '[rlrun time info]' prefix)."""
    parts = [f"step {step}/{total}"]
    parts += [f"{name} {metrics[key]:{fmt}}" for key, name, fmt in SHOWN
              if isinstance(metrics.get(key), (int, float))]
    if seconds_per_step is not None:
        parts.append(f"{seconds_per_step:.2f} s/step")
        parts.append(f"ETA {format_duration(seconds_per_step * max(0, total - step))}")
    if evals:
        parts.append(format_eval(evals))
    return " | ".join(parts)


class LineProgress:
    """One line per logged step on `stream` (stdout), timed from the first step of this run."""

    def __init__(self, total: int, start_step: int, stream: TextIO, clock: Callable[[], float] = time.monotonic,
                 stamp: Callable[[], str] = lambda: time.strftime("%H:%M:%S")) -> None:
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


def make_progress(total: int, start_step: int, stdout: TextIO | None = None, stderr: TextIO | None = None,
                  environ: Mapping[str, str] | None = None) -> LineProgress | BarProgress:
    """A bar when both stdout and stderr are terminals (the bar draws on stderr), else lines on stdout."""
    out, err = stdout or sys.stdout, stderr or sys.stderr
    env = os.environ if environ is None else environ
    if is_terminal(out) and is_terminal(err):
        return BarProgress(total, start_step, enabled=env.get("RLRUN_NO_PROGRESS") != "1")
    return LineProgress(total, start_step, out)
