"""Stacked phase bars for bench/vs_trl.py's results (needs matplotlib; runs in the TRL venv).

    bench/.venv-trl/bin/python bench/vs_trl_plot.py bench/results/vs_trl.json bench/results/vs_trl.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PHASES = ("generate", "score", "train", "sync")
COLOURS = {"generate": "#4c72b0", "score": "#dd8452", "train": "#55a868", "sync": "#c44e52"}


def main(json_path: str, png_path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(Path(json_path).read_text())
    summary = report["summary"]
    names = list(summary)
    fig, ax = plt.subplots(figsize=(7, 4))
    bottoms = [0.0] * len(names)
    for phase in PHASES:
        heights = [summary[n]["phases_s"][phase] for n in names]
        ax.bar(names, heights, bottom=bottoms, label=phase, color=COLOURS[phase])
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for i, name in enumerate(names):
        total = summary[name]["median_s_per_step"]
        ax.text(i, max(total, bottoms[i]) * 1.01, f"{total:.2f} s", ha="center", va="bottom")
    wl, args = report["workload"], report["args"]
    title = (f"GRPO step, {wl['num_params'] / 1e6:.1f}M-param Qwen2, {wl['prompts_per_step']}x{wl['samples_per_prompt']}"
             f" samples x {wl['max_new_tokens']} tokens, {args['threads']} CPU threads")
    if report.get("smoke"):
        title += "\nSMOKE RUN - not comparable"
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(f"median s/step (steps {report['warmup_steps_excluded'] + 1}..{args['steps']}, "
                  f"{args['rounds']} round(s))")
    ax.set_ylim(0, max(bottoms + [s["median_s_per_step"] for s in summary.values()]) * 1.15)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
