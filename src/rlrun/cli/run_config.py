"""A run's resolved settings as ``config.yaml`` in its save path, so that ``--config <save_path>/config.yaml`` reruns
the same configuration: the command line's inverse (rlrun.cli.parser reads the file back).

The file holds the settings that differ from the trainer's defaults (a full dump would also mark every setting
as given, which turns on "has no effect" notes for settings nobody set), nested by section as ``--config``
reads them, with the values the run used: hub ids as their local snapshots, ``--generation_backend auto`` as the
backend it chose. Secrets stay out (rlrun.runtime.secrets, through rlrun.config.fields.redacted): a masked value
is named in the header, since a rerun needs it given again. Settings that only shape a ``--dry_run`` preflight
are left out: stored, ``--dry_run`` would turn the rerun into a preflight.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import yaml

from rlrun.config.fields import fields_of, redacted
from rlrun.config.tree import RootConfig

CONFIG_FILE = "config.yaml"
NOT_SAVED = frozenset({"dry_run", "plan_json", "gpu_memory_gb"})  # the preflight's, not the run's


def run_settings(cfg: RootConfig, defaults: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """({section: {field: value}} of the settings that differ from the defaults (`defaults`: the trainer's own
    defaults of shared fields, over the schema's), as YAML holds them; the names whose value is not stored as
    it was (secrets, credentials inside URLs): a rerun must give them again)."""
    shown = redacted(cfg)
    out: dict[str, dict[str, Any]] = {}
    withheld = []
    for info in fields_of(type(cfg)).values():
        value = getattr(getattr(cfg, info.section), info.name)
        if info.name in NOT_SAVED or value == defaults.get(info.name, info.default):
            continue
        stored = shown[info.section][info.name]
        if info.name == "use_wandb":  # YAML true means on, the key from WANDB_API_KEY (rlrun.cli.parser.load_yaml)
            stored = True
            if value:
                withheld.append("use_wandb (its key: set WANDB_API_KEY)")
        elif info.secret:
            withheld.append(info.name)
            continue
        elif stored != value:
            withheld.append(info.name)
        out.setdefault(info.section, {})[info.name] = list(stored) if isinstance(stored, tuple) else stored
    return out, withheld


def write_run_config(
    cfg: RootConfig, defaults: Mapping[str, Any], directory: str, prog: str, launched: str = ""
) -> tuple[str, int]:
    """Write `directory`/config.yaml (atomically); (its path, how many settings it holds). `prog`: the entry point
    ('python -m rlrun.ppo'); `launched`: how the run was started, for the header (e.g. '2 ranks, torchrun')."""
    settings, withheld = run_settings(cfg, defaults)
    path = os.path.join(directory, CONFIG_FILE)
    header = [
        f"{prog}: the settings of the run saved in {directory} that differ from the defaults "
        f"(written {time.strftime('%Y-%m-%d %H:%M:%S')}{', ' + launched if launched else ''}).",
        f"Rerun: {prog} --config {path}  (flags after it still win)",
    ]
    if withheld:
        header.append(f"Not stored as given (secrets): {', '.join(withheld)}; give them again to rerun.")
    text = "".join(f"# {line}\n" for line in header)
    text += (
        yaml.safe_dump(settings, sort_keys=False, default_flow_style=False, allow_unicode=True) if settings else "{}\n"
    )
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)
    return path, sum(len(fields) for fields in settings.values())
