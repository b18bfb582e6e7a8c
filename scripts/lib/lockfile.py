"""Lock files of resolved versions (scripts/lock.sh writes them, scripts/check_latest.sh compares against them).

    python3 scripts/lib/lockfile.py write REPORT.json [REPORT.json ...] > LOCK   # pip --report(s) -> name==version
    python3 scripts/lib/lockfile.py diff LOCK FREEZE                               # what changed, one line each

A lock line is `name==version`, the name normalised as PEP 503 does; it is read by pip as a constraints file
(`pip install -c LOCK ...`), so it pins whatever the install asks for and installs nothing by itself. Standard
library only: it runs before any venv exists.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def normalised(name: str) -> str:
    """PEP 503's form of a distribution name (what pip compares): `Foo_bar.baz` -> `foo-bar-baz`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def resolved(report: Path) -> dict[str, str]:
    """{name: version} of what a `pip install --dry-run --report` would install, the editable project left out
    (it is installed from the checkout, never from an index). Local version labels are dropped (torch 2.13.0+cpu
    -> 2.13.0): `==2.13.0` matches the local build and also the index's, where a GPU container has its own."""
    found: dict[str, str] = {}
    for item in json.loads(report.read_text())["install"]:
        if item.get("download_info", {}).get("dir_info", {}).get("editable"):
            continue
        meta = item["metadata"]
        found[normalised(meta["name"])] = meta["version"].split("+")[0]
    return found


def read_pins(path: Path) -> dict[str, str]:
    """{name: version} of a lock or `pip freeze` file; comments, blank and non-pinned lines (editables) skipped."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line and not line.startswith("-"):
            name, version = line.split("==", 1)
            pins[normalised(name)] = version.strip().split("+")[0]
    return pins


# In every venv and never locked: the installer itself and the project (installed from the checkout).
UNLOCKED = frozenset({"pip", "setuptools", "wheel", "rlrun"})


def changes(locked: dict[str, str], latest: dict[str, str]) -> list[str]:
    """One line per package whose version differs, appeared or left, sorted by name."""
    lines = []
    for name in sorted((locked.keys() | latest.keys()) - UNLOCKED):
        old, new = locked.get(name), latest.get(name)
        if old == new:
            continue
        if old is None:
            lines.append(f"  + {name} {new} (not in the lock)")
        elif new is None:
            lines.append(f"  - {name} {old} (no longer installed)")
        else:
            lines.append(f"  ~ {name} {old} -> {new}")
    return lines


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "write":
        pins: dict[str, str] = {}
        for report in argv[1:]:
            pins.update(resolved(Path(report)))
        sys.stdout.write("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
        return 0
    if len(argv) == 3 and argv[0] == "diff":
        lines = changes(read_pins(Path(argv[1])), read_pins(Path(argv[2])))
        print("\n".join(lines) if lines else "  (nothing: the newest versions are the locked ones)")
        return 0
    print("usage: lockfile.py write REPORT.json [...] | lockfile.py diff LOCK FREEZE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
