"""Strategy rules that need the layout, checked in planning on every rank before any group or model exists."""

from __future__ import annotations

import importlib.util
from importlib.metadata import PackageNotFoundError, version

from rlrun.config.schema import Config, OptimConfig
from rlrun.launch.layout import Layout, Role
from rlrun.runtime.errors import ConfigError

# The DeepSpeed releases rlrun's adapter was tested with (it relies on mpu, explicit accumulation boundaries,
# safe_get/set_full_*, the ZeRO-1/2 optimizer's partition attributes and ZeRO-3's flat fp32 sub-groups).
# Same range as setup.cfg's extra.
DEEPSPEED_TESTED = ((0, 19, 8), (0, 20, 0))
SHARDED_ROLES = (Role.ACTOR, Role.CRITIC, Role.REF, Role.REWARD)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 1 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def check_strategy(cfg: Config, layout: Layout) -> None:
    """--strategy deepspeed: installed in the tested range; ZeRO-3 only where every sharded role spans the world."""
    t = cfg.train
    if t.strategy != "deepspeed":
        return
    check_deepspeed_install()
    if t.zero_stage == 3:
        roles = [r for r in SHARDED_ROLES if layout.has(r)]
        narrow = [r for r in roles if len(layout.ranks_of(r)) < layout.world_size]
        if narrow:
            role = narrow[0]
            raise ConfigError(
                f"--strategy deepspeed --zero_stage 3 needs the role ({role.value}: {_ranks(layout.ranks_of(role))}) to "
                f"span all {layout.world_size} ranks: DeepSpeed ZeRO-3 calls world-wide barriers at init and broadcasts "
                "from global rank 0 in its forward hooks (deepspeed/runtime/zero/stage3.py:914, "
                "partitioned_param_coordinator.py:260), which deadlock when other roles train on other ranks. "
                "Use --strategy fsdp --zero_stage 3 (comparable memory profile, works on role groups).")
    check_deepspeed_settings(t, cfg.model.bf16, saves=cfg.checkpoint.save_steps > 0 or cfg.checkpoint.load_checkpoint)


def check_deepspeed_install() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("--strategy deepspeed needs DeepSpeed: pip install 'rlrun[deepspeed]' (deepspeed>=0.19.8,<0.20), "
                          "or use --strategy fsdp")
    try:
        found = version("deepspeed")
    except PackageNotFoundError:
        found = "unknown"
    low, high = DEEPSPEED_TESTED
    if not low <= _version_tuple(found) < high:
        raise ConfigError(f"--strategy deepspeed is tested with deepspeed>=0.19.8,<0.20, found {found}: "
                          "pip install 'rlrun[deepspeed]', or use --strategy fsdp")


def check_deepspeed_settings(train: OptimConfig, bf16: bool, *, saves: bool) -> None:
    """The --strategy deepspeed rules that hold whatever the layout (every model on every rank included)."""
    if train.zero_stage == 0 and train.adam_offload:
        raise ConfigError("--strategy deepspeed --zero_stage 0 --adam_offload: DeepSpeed offloads the optimizer only at "
                          "ZeRO stages 1-3 (at stage 0 DeepSpeedCPUAdam would receive GPU parameters and assert); use "
                          "--zero_stage 1 or 2 with --adam_offload, or drop --adam_offload")
    if train.zero_stage == 0 and bf16 and saves:
        raise ConfigError("--strategy deepspeed --zero_stage 0 --bf16 cannot save or load checkpoints yet (its fp32 master "
                          "weights are not reachable by parameter); use --zero_stage 1 or 2, or drop --save_steps/"
                          "--load_checkpoint")
