"""What changed between the config a checkpoint was written with and the config resuming from it.

A resume continues a run, so a change is either impossible to honour (the weights, the algorithm's state or
the position in the data would no longer mean what they meant: an error naming the reason) or applied from
the next step and said once (learning rates, step counts, logging, the number of ranks). Each trainer names
its own impossible changes: a PPO step consumes rollout_batch_size prompts, an SFT step train_batch_size
samples. Both configs are compared as stored: redacted (rlrun.config.fields.redacted), so secrets never
appear in a message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


# How the run is started, not what it trains: never worth a line.
NOT_A_CHANGE = frozenset({"load_checkpoint", "overwrite_checkpoints", "ckpt_path", "dry_run", "plan_json",
                          "gpu_memory_gb"})


@dataclass(frozen=True)
class Change:
    name: str
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"--{self.name} {_show(self.before)} -> {_show(self.after)}"


@dataclass
class ResumeChanges:
    refused: list[tuple[Change, str]] = field(default_factory=list)  # (change, why it cannot be applied)
    applied: list[Change] = field(default_factory=list)


def _show(value: Any) -> str:
    text = "unset" if value is None else repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _flat(config: Mapping[str, Any]) -> dict[str, Any]:
    """{field: value} of a nested {section: {field: value}} config dict (field names are unique: they are flags)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            out.update(value)
        else:
            out[key] = value
    return out


def resume_changes(stored: Mapping[str, Any], current: Mapping[str, Any], fixed: Mapping[str, str]) -> ResumeChanges:
    """Every setting whose value differs, split into refused (named in `fixed`, with its reason) and applied."""
    # As stored: through JSON, so a tuple and the list it was saved as are the same value.
    before, after = _flat(json.loads(json.dumps(stored, default=str))), _flat(json.loads(json.dumps(current, default=str)))
    changes = ResumeChanges()
    for name in sorted(set(before) | set(after)):
        if name in NOT_A_CHANGE or name not in before or name not in after or before[name] == after[name]:
            continue  # a setting the checkpoint's rlrun did not have keeps its default meaning
        change = Change(name, before[name], after[name])
        if name in fixed:
            changes.refused.append((change, fixed[name]))
        else:
            changes.applied.append(change)
    return changes


def check_resume(meta: Mapping[str, Any], current: Mapping[str, Any], fixed: Mapping[str, str], path: str,
                 say: Callable[[str], None]) -> str | None:
    """Why the checkpoint `meta` records cannot continue with this run's (redacted) config `current` (None: it
    can; then what the resume changes, if anything, goes to `say` in one line)."""
    stored = meta.get("config")
    if not isinstance(stored, Mapping):
        return None  # written before configs were stored: nothing to compare
    changes = resume_changes(stored, current, fixed)
    if changes.refused:
        change, why = changes.refused[0]
        more = f" (and {len(changes.refused) - 1} more: " + ", ".join(str(c) for c, _ in changes.refused[1:]) + ")" \
            if len(changes.refused) > 1 else ""
        return (f"cannot resume the step-{meta.get('step')} checkpoint in {path} with {change}{more}: {why}. Resume "
                "with the checkpoint's value, or start a new run with a fresh --ckpt_path")
    if changes.applied:
        say("resuming with changed settings (applied from the next step): " + ", ".join(map(str, changes.applied)))
    return None
