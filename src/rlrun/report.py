"""`python -m rlrun.report RUN_DIR`: a run's summary (summary.json, and the lines a run prints at its end) and the
PNG of its main curves, computed again from its metrics.jsonl: for a run still going, one that stopped early, or
one trained where matplotlib was missing. RUN_DIR is a run's --save_path, or a metrics JSONL file itself (a
--metrics_file elsewhere); the outputs go beside the metrics file (rlrun.reporting.summary.outputs_beside).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rlrun.reporting.run_report import write_report
from rlrun.reporting.summary import METRICS_FILE
from rlrun.runtime.log import get_logger


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m rlrun.report",
        description="A run's summary (summary.json) and "
        "the PNG of its main curves, computed again from its metrics.jsonl.",
    )
    parser.add_argument(
        "run", metavar="RUN_DIR", help=f"a run's save path (holding {METRICS_FILE}), or a metrics JSONL file"
    )
    args = parser.parse_args(argv)
    log = get_logger(0)
    metrics = args.run if os.path.isfile(args.run) else os.path.join(args.run, METRICS_FILE)
    if not os.path.isfile(metrics):
        log.error_once(
            f"error: no {metrics}: give a run's --save_path (it holds {METRICS_FILE}) or a metrics JSONL file"
        )
        return 2
    try:
        lines, why = write_report(metrics)
    except OSError as exc:
        log.error_once(f"error: cannot write the report beside {metrics}: {exc.strerror or exc}")
        return 1
    for line in lines:
        log.info_once(line)
    if why is not None:
        log.warning_once(f"no curves plotted: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
