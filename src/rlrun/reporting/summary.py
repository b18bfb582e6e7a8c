"""A run's summary from its metrics file: steps, time per phase, tokens/s, first/last/best of the main curves.

Read from metrics.jsonl alone (rlrun.reporting.metrics writes it), so the end of a run and
``python -m rlrun.report RUN_DIR`` compute the same thing; what only the run knows (its wall time, where it
saved what, how it ended) is kept under ``"run"`` and carried over when the summary is computed again.
Training records carry ``time/step``; evaluation records are those with ``eval/`` keys.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

# ---- curves ------------------------------------------------------------------------------------------------------
# The PNG of a run's main curves (reward, KL, response length, step time; loss and accuracy for rlrun.sft/rm/dpo;
# evaluation results as a second line or panel), drawn from its metric records with matplotlib.
#
# matplotlib is imported here only, and only when plotting (it is a dependency, but a GPU container may lack it):
# without it `plot_curves` says why in one short reason and draws nothing; it never fails a run. The figure is
# drawn with matplotlib's object API on the Agg canvas (no pyplot, no global backend state).

# (title, training key, evaluation key): a panel is drawn when either is logged. "eval/pass@" is a prefix.
PANELS = (
    ("reward", "reward", "eval/reward"),
    ("KL", "kl", None),
    ("response length", "response_length", "eval/response_length"),
    ("loss", "loss", "eval/loss"),
    ("accuracy", "acc", "eval/acc"),
    ("eval pass@N", None, "eval/pass@"),
    ("step time (s)", "time/step", None),
)


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


def _series(records: Sequence[Mapping[str, Any]], key: str) -> dict[str, tuple[list[int], list[float]]]:
    """{key: (steps, values)} of the finite values; a key ending in '@' stands for every key it starts."""
    keys = sorted({k for r in records for k in r if k.startswith(key)}) if key.endswith("@") else [key]
    out = {}
    for name in keys:
        points = [
            (int(r["step"]), float(r[name]))
            for r in records
            if isinstance(r.get(name), (int, float)) and not isinstance(r.get(name), bool)
        ]
        if points:
            out[name] = ([s for s, _ in points], [v for _, v in points])
    return out


def plot_curves(records: Sequence[Mapping[str, Any]], path: str, title: str = "") -> str | None:
    """Draw the panels whose metrics are logged into `path` (PNG, written atomically); None when drawn, else the
    reason nothing was drawn."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415 - optional at run time
        from matplotlib.figure import Figure  # noqa: PLC0415
        from matplotlib.ticker import MaxNLocator  # noqa: PLC0415
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    train = [r for r in records if not is_eval(r)]
    evals = [r for r in records if is_eval(r)]
    panels = [(name, _series(train, tk) if tk else {}, _series(evals, ek) if ek else {}) for name, tk, ek in PANELS]
    panels = [p for p in panels if p[1] or p[2]]
    if not panels:
        return "no curves logged yet"
    columns = 2 if len(panels) > 1 else 1
    rows = (len(panels) + columns - 1) // columns
    fig = Figure(figsize=(6 * columns, 3.2 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    for index, (name, lines, eval_lines) in enumerate(panels):
        ax = fig.add_subplot(rows, columns, index + 1)
        for key, (steps, values) in lines.items():
            ax.plot(steps, values, label="train" if eval_lines else key, linewidth=1.2)
        for key, (steps, values) in eval_lines.items():
            ax.plot(steps, values, marker="o", markersize=3, linewidth=1.2, label=key)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(lines) + len(eval_lines) > 1:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, path)
    return None


METRICS_FILE = "metrics.jsonl"
# The curves summarised, when logged: training's, then evaluation's (eval/pass@N too). Lower is better for losses.
CURVES = ("reward", "loss", "acc")
EVAL_CURVES = ("eval/reward", "eval/loss", "eval/acc")
PHASES = ("generate", "score", "train", "sync", "wait_rollout")  # time/<phase> of a PPO step


def outputs_beside(metrics_path: str) -> tuple[str, str]:
    """(summary JSON, curves PNG) paths beside a metrics file: summary.json and curves.png for metrics.jsonl,
    <stem>_summary.json and <stem>_curves.png for another name (a --metrics_file shared folder stays unambiguous)."""
    folder, name = os.path.split(metrics_path)
    prefix = "" if name == METRICS_FILE else os.path.splitext(name)[0] + "_"
    return os.path.join(folder, f"{prefix}summary.json"), os.path.join(folder, f"{prefix}curves.png")


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics JSONL file, skipping a line cut short by a crash."""
    records = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
                records.append(record)
    return records


def is_eval(record: Mapping[str, Any]) -> bool:
    return any(key.startswith("eval/") for key in record)


def _number(value: Any) -> float | None:
    return (
        float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else None
    )


def _curve(records: Sequence[Mapping[str, Any]], key: str) -> dict[str, float] | None:
    points = [(int(r["step"]), v) for r in records if (v := _number(r.get(key))) is not None]
    if not points:
        return None
    pick = min if key.endswith("loss") else max
    best = pick(points, key=lambda p: p[1])  # the earliest step of the best value
    return {
        "first": points[0][1],
        "first_step": points[0][0],
        "last": points[-1][1],
        "last_step": points[-1][0],
        "best": best[1],
        "best_step": best[0],
        "points": len(points),
    }


# The steps' median throughput per device and actor MFU (rlrun.reporting.live), as the summary names them.
PERF = (("throughput_per_device", "perf/throughput"), ("mfu_actor", "perf/mfu/actor"))


def _median(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    values = [v for r in records if (v := _number(r.get(key))) is not None]
    return statistics.median(values) if values else None


def summarize(records: Sequence[Mapping[str, Any]], metrics_path: str = "") -> dict[str, Any]:
    """The summary of a run's metric records (see the module docstring)."""
    train = [r for r in records if not is_eval(r)]
    evals = [r for r in records if is_eval(r)]
    timed = [r for r in train if _number(r.get("time/step")) is not None]
    step_s = sum(float(r["time/step"]) for r in timed)
    phases = {p: sum(_number(r.get(f"time/{p}")) or 0.0 for r in timed) for p in PHASES}
    with_tokens = [r for r in timed if _number(r.get("tokens_per_s")) is not None]
    tokens = sum(float(r["tokens_per_s"]) * float(r["time/step"]) for r in with_tokens)
    token_s = sum(float(r["time/step"]) for r in with_tokens)
    eval_keys = list(EVAL_CURVES) + sorted({k for r in evals for k in r if k.startswith("eval/pass@")})
    curves = {key: c for key in CURVES if (c := _curve(train, key)) is not None}
    curves.update({key: c for key in eval_keys if (c := _curve(evals, key)) is not None})
    skipped = max((_number(v) or 0.0 for r in train for k, v in r.items() if k.endswith("skipped_steps")), default=0.0)
    return {
        "metrics_file": metrics_path,
        "steps": int(max((r["step"] for r in train), default=0)),
        "logged_steps": len(train),
        "evaluations": len(evals),
        "time": {
            "steps_s": step_s,
            "per_step_s": step_s / len(timed) if timed else None,
            "phases_s": {p: s for p, s in phases.items() if s > 0},
        },
        "tokens_per_s": tokens / token_s if token_s > 0 else None,
        **{name: _median(train, key) for name, key in PERF},
        "curves": curves,
        "skipped_updates": int(skipped),
    }


def _seconds(seconds: float) -> str:
    """'4.2s' under a minute, else format_duration's '1m05s'."""
    return f"{seconds:.1f}s" if seconds < 59.95 else format_duration(seconds)


def _value(key: str, value: float) -> str:
    return f"{value:.4f}" if key.endswith("loss") else f"{value:.3f}"


def format_summary(summary: Mapping[str, Any]) -> list[str]:
    """The lines printed at the end of a run (and by python -m rlrun.report)."""
    t = summary["time"]
    head = f"summary: {summary['steps']} steps"
    if t["per_step_s"] is not None:
        total = t["steps_s"]
        shares = ", ".join(f"{p} {s / total:.0%}" for p, s in t["phases_s"].items()) if total > 0 else ""
        head += f", {_seconds(total)} in steps ({t['per_step_s']:.2f} s/step{': ' + shares if shares else ''})"
    if summary.get("tokens_per_s") is not None:
        head += f", {summary['tokens_per_s']:.0f} generated tokens/s"
    if summary.get("throughput_per_device") is not None:
        head += f", {summary['throughput_per_device']:.0f} tokens/s per device"
    if summary.get("mfu_actor") is not None:
        head += f", MFU {summary['mfu_actor']:.1%}"
    run = summary.get("run", {})
    if run.get("wall_s") is not None:
        head += f"; {_seconds(run['wall_s'])} from start-up to the end"
    if run.get("outcome") not in (None, "finished"):
        head += f" ({run['outcome']})"
    lines = [head]
    skipped = summary.get("skipped_updates") or 0
    for key, c in summary["curves"].items():
        first, last, best = (_value(key, c[k]) for k in ("first", "last", "best"))
        if key.startswith("eval/"):
            lines.append(
                f"{key}: first {first} at step {c['first_step']}, last {last} at step {c['last_step']}, "
                f"best {best} at step {c['best_step']}"
            )
        else:
            note = f"; {skipped} updates skipped for non-finite gradients" if skipped else ""
            lines.append(
                f"{key}: first step {first}, last step {last}, best {best} at step {c['best_step']} "
                f"({c['points']} steps{note})"
            )
    saved = run.get("saved") or {}
    if saved:
        lines.append("saved: " + ", ".join(f"{what} {where}" for what, where in saved.items()))
    return lines


def write_summary(summary: Mapping[str, Any], path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)
        fh.write("\n")
    os.replace(tmp, path)
