"""What the prose points at exists: every rlrun module a docstring or comment cites (`rlrun.x.y`, or a path such as
`engines/vllm/stream.py` under one of the package's folders) is a module of today's package, every relative link of
README.md and docs/*.md reaches a file, and the README fits a screen or two (a newcomer's first page; the rest is in
docs/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from doc_env import REPO

PACKAGE = REPO / "src" / "rlrun"
FOLDERS = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
MODULES = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
           for p in PACKAGE.rglob("*.py")}
PACKAGES = {m for m in MODULES if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").is_file()}
README_BYTES = 12 * 1024

# `rlrun.a.b` (possibly followed by an attribute), and `folder/.../file.py` not inside a longer path (a peer's path,
# e.g. verl/trainer/ppo/core_algos.py, is cited with the peer's root and so never starts at one of rlrun's folders).
DOTTED = re.compile(r"\brlrun(?:\.[A-Za-z_0-9]+)+")
PATH = re.compile(r"(?<![\w/.{-])((?:[a-z_0-9]+/)+[a-z_0-9]+\.py)\b")


def _dotted_exists(name: str) -> bool:
    """A module, or a module's attribute (a package's attribute would hide a missing module: it does not count)."""
    parts = name.split(".")
    longest = next((".".join(parts[:k]) for k in range(len(parts), 1, -1) if ".".join(parts[:k]) in MODULES), None)
    return longest == name or (longest is not None and longest not in PACKAGES)


def _path_exists(path: str) -> bool:
    return (PACKAGE / path).is_file() or (REPO / path).is_file()


def stale_citations(source: str) -> list[str]:
    """The citations of rlrun modules in `source` (one module's text) that name no module of the package."""
    stale = []
    for number, line in enumerate(source.splitlines(), 1):
        if line.lstrip().startswith(("import ", "from ")):
            continue
        stale += [f"{number}: {m.group(0)}" for m in DOTTED.finditer(line) if not _dotted_exists(m.group(0))]
        stale += [f"{number}: {m.group(1)}" for m in PATH.finditer(line)
                  if m.group(1).split("/")[0] in FOLDERS and not _path_exists(m.group(1))]
    return stale


def test_cited_modules_exist():
    stale = {str(path.relative_to(REPO)): found for path in sorted(PACKAGE.rglob("*.py"))
             if (found := stale_citations(path.read_text()))}
    assert not stale, f"docstrings and comments citing modules that do not exist: {stale}"


def test_the_check_sees_a_stale_citation():
    text = ('"""After rlrun.engines.hosting and roles/engine.py; rlrun.engines.build.build_engine and\n'
            'engines/vllm/stream.py exist, verl/trainer/ppo/core_algos.py is verl\'s."""\n')
    assert stale_citations(text) == ["1: rlrun.engines.hosting", "1: roles/engine.py"]


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            broken.append(target)
    assert not broken, f"{doc.name}: links to nothing: {broken}"


def test_the_readme_fits_a_screen():
    size = len((REPO / "README.md").read_bytes())
    assert size <= README_BYTES, f"README.md is {size} bytes (<= {README_BYTES}): move detail into docs/"
