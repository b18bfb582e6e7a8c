"""The PNG of a run's main curves (reward, KL, response length, step time; loss and accuracy for rlrun.sft/rm/dpo;
evaluation results as a second line or panel), drawn from its metric records with matplotlib.

matplotlib is imported here only, and only when plotting (it is a dependency, but a GPU container may lack it):
without it `plot_curves` says why in one short reason and draws nothing; it never fails a run. The figure is
drawn with matplotlib's object API on the Agg canvas (no pyplot, no global backend state).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from rlrun.reporting.summary import is_eval

# (title, training key, evaluation key): a panel is drawn when either is logged. "eval/pass@" is a prefix.
PANELS = (("reward", "reward", "eval/reward"), ("KL", "kl", None),
          ("response length", "response_length", "eval/response_length"), ("loss", "loss", "eval/loss"), ("accuracy", "acc", "eval/acc"), ("eval pass@N", None, "eval/pass@"),
          ("step time (s)", "time/step", None))


def _series(records: Sequence[Mapping[str, Any]], key: str) -> dict[str, tuple[list[int], list[float]]]:
    """{key: (steps, values)} of the finite values; a key ending in '@' stands for every key it starts."""
    keys = sorted({k for r in records for k in r if k.startswith(key)}) if key.endswith("@") else [key]
    out = {}
    for name in keys:
        points = [(int(r["step"]), float(r[name])) for r in records
                  if isinstance(r.get(name), (int, float)) and not isinstance(r.get(name), bool)]
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
