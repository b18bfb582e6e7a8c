"""The RL step reads as the algorithm (issue 61): rl/trainer.py reads nothing by a string key (the step's data is
typed: Scored, Advantages, Learned; metric names are only written, and the checkpoint's state dict is torch's
Stateful protocol) and never rewrites a batch's mask in place (the masks the correction and the filtering leave are
returned), checked on its syntax tree."""

from __future__ import annotations

import ast

from helpers import REPO

TRAINER = REPO / "src" / "rlrun" / "rl" / "trainer.py"
STATEFUL = {"state_dict", "load_state_dict"}


def string_lookups_and_mask_edits(source: str) -> list[str]:
    found = []
    tree = ast.parse(source)
    skipped = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in STATEFUL
               for n in ast.walk(f)}
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Constant)
                and isinstance(node.slice.value, str)):
            found.append(f"{node.lineno}: [{node.slice.value!r}]")
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        else:
            targets = []
        found += [f"{node.lineno}: .{t.attr} =" for t in targets if isinstance(t, ast.Attribute) and t.attr.endswith("mask")]
    return sorted(found, key=lambda entry: int(entry.split(":")[0]))


def test_the_step_has_no_string_lookups_and_no_mask_edits():
    assert not string_lookups_and_mask_edits(TRAINER.read_text())


def test_the_check_sees_both():
    code = 'x = results["old_log_probs"]\nbatch.action_mask = m\nb.action_mask *= k\nlogs["kl"] = 1.0\n'
    assert string_lookups_and_mask_edits(code) == ["1: ['old_log_probs']", "2: .action_mask =", "3: .action_mask ="]
