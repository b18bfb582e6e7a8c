"""Entry point: `torchrun -m rlrun.ppo ...`, `srun python -m rlrun.ppo ...` or `python -m rlrun.ppo ...`.

Parse and validate everything first (cheap, identical on every rank), then init, build, train,
and always tear down.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

from rlrun.cli.parser import ParsedArgs, parse_args
from rlrun.launch.dist import uses_cuda
from rlrun.launch.env import read_node_label
from rlrun.launch.failures import checked_on_every_rank, launch_environment, leave
from rlrun.launch.layout_text import format_layout_table, layout_heading
from rlrun.models.adapter_pretrain import resolve_adapter_pretrain
from rlrun.models.hub import resolve_models
from rlrun.rl.planning import check_adapter_reference
from rlrun.rl.planning import Plan, asks_node_labels, plan
from rlrun.runtime.log import get_logger
from rlrun.vision.preset import resolve_vl_preset

if TYPE_CHECKING:
    from rlrun.engines.choice import GenerationChoice


def main(argv: Sequence[str] | None = None) -> int:
    env = launch_environment()
    if env is None:
        return 2
    log = get_logger(env.rank)

    def parse() -> tuple[ParsedArgs, "GenerationChoice", Plan]:
        parsed = parse_args(argv)
        cfg = resolve_vl_preset(parsed.config)  # --model_preset tiny-vl: a saved model (and data) in rlrun's cache
        # Hub ids become their cached snapshots (downloaded now, unless this is a dry run or HF_HUB_OFFLINE=1).
        cfg = dataclasses.replace(cfg, model=resolve_models(cfg.model, download=not cfg.runtime.dry_run))
        # An adapter directory as --pretrain: its base resolved, its LoRA settings in the config (the layout and the
        # memory plan follow them).
        cfg = dataclasses.replace(cfg, model=resolve_adapter_pretrain(cfg.model, download=not cfg.runtime.dry_run))
        check_adapter_reference(cfg)
        parsed = dataclasses.replace(parsed, config=cfg)
        # One node: its label is this process's own, so pinned roles are placed (and checked) now; with more
        # nodes the labels are gathered at start-up (rlrun.rl.run) and the placement is redone there.
        one_node = env.world_size == env.local_world_size
        labels = (read_node_label(),) if asks_node_labels(parsed.config) and one_node else None
        first = plan(parsed.config, env.world_size, env.local_world_size, labels)  # bad layouts fail before the import below
        from rlrun.engines.choice import choose_generation  # noqa: PLC0415 - imports transformers (seconds)
        from rlrun.vision.support import check_vision_run  # noqa: PLC0415

        choice = choose_generation(parsed.config, uses_cuda(parsed.config.runtime.device))
        check_vision_run(choice.config)
        if choice.backend == parsed.config.generation.generation_backend:
            return parsed, choice, first
        return parsed, choice, plan(choice.config, env.world_size, env.local_world_size, labels)

    checked = checked_on_every_rank(env, parse)
    if checked is None:
        return 2
    parsed, choice, the_plan = checked
    cfg = choice.config
    one_node = env.world_size == env.local_world_size
    if cfg.runtime.dry_run:
        if choice.assumed is not None:
            log.info_once(choice.assumed)
        log.info_once(f"{layout_heading(env)}\n{format_layout_table(the_plan.layout)}")
        if asks_node_labels(cfg) and not one_node:
            log.info_once("roles pinned by --*_node_label are placed at start-up, once every node has reported its "
                          "label (RLRUN_NODE_LABEL, else the host name); the table above ignores the labels")
        from rlrun.rl.memory_text import dry_run_memory  # noqa: PLC0415 - imports transformers

        memory = checked_on_every_rank(env, lambda: dry_run_memory(cfg, the_plan.layout, write_json=env.rank == 0))
        if memory is None:
            return 2
        for line in memory[0]:
            log.info_once(line)
        for line in memory[1]:
            log.warning_once(line)
    for line in (*parsed.ignored_under(choice.backend), *the_plan.warnings):
        log.warning_once(line)
    if cfg.runtime.dry_run:
        from rlrun.rl.preflight import preflight  # noqa: PLC0415 - imports transformers and the reward code

        lines = checked_on_every_rank(env, lambda: preflight(cfg))
        if lines is None:
            return 2
        for line in lines:
            log.info_once(line)
        return 0
    from rlrun.rl.run import run

    return run(cfg, env, the_plan.layout, choice.why)


if __name__ == "__main__":
    leave(main())
