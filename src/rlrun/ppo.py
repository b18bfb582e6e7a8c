"""Entry point: `torchrun -m rlrun.ppo ...`, `srun python -m rlrun.ppo ...` or `python -m rlrun.ppo ...`.

Parse and validate everything first (cheap, identical on every rank), then init, build, train,
and always tear down.
"""

from __future__ import annotations

import sys
import time
from typing import Sequence

from rlrun.cli import parse_args
from rlrun.errors import RlrunError
from rlrun.launch.env import read_env
from rlrun.launch.layout import format_layout_table
from rlrun.launch.planning import plan
from rlrun.log import get_logger

# After a config error, ranks other than 0 wait this long before exiting: torchrun stops all workers as soon as
# one fails, so a rank 1 that exits first could kill rank 0 before it prints the one message.
ERROR_GRACE_S = 10.0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        env = read_env()
    except RlrunError as exc:
        # The rank itself is unknown, so every process reports (a traceback would say no more).
        get_logger(0).error_once(f"error: {exc}")
        return 2
    log = get_logger(env.rank)
    try:
        parsed = parse_args(argv)
        cfg = parsed.config
        the_plan = plan(cfg, env.world_size, env.local_world_size)
    except RlrunError as exc:
        # Every rank sees the same argv and fails the same way; one message is enough.
        log.error_once(f"error: {exc}")
        if env.rank != 0:
            time.sleep(ERROR_GRACE_S)  # normally cut short: the launcher stops us when rank 0 exits
        return 2
    for line in parsed.ignored:
        log.warning_once(line)
    if cfg.runtime.dry_run:
        log.info_once(f"layout for world size {env.world_size} ({env.local_world_size} ranks per node, launcher {env.launcher}):\n"
                      + format_layout_table(the_plan.layout))
        for line in the_plan.warnings:
            log.warning_once(line)
        return 0
    for line in the_plan.warnings:
        log.warning_once(line)
    from rlrun.run import run

    return run(cfg, env, the_plan.layout)


if __name__ == "__main__":
    sys.exit(main())
