"""The locks of resolved versions (requirements/*-lock.txt, scripts/lock.sh): they satisfy setup.cfg's ranges, this
environment is the lock's (scripts/install.sh --test installed it), and scripts/lib/lockfile.py reads pip's
--report and compares versions as it says."""

from __future__ import annotations

import configparser
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from helpers import REPO

sys.path.insert(0, str(REPO / "scripts" / "lib"))
import lockfile  # noqa: E402 - a script's module, found through the path above

TEST_LOCK = REPO / "requirements" / "test-lock.txt"
VLLM_LOCK = REPO / "requirements" / "vllm-lane-lock.txt"


def _requirements(*sections: tuple[str, str]) -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = [line for section, key in sections for line in cfg[section][key].splitlines()]
    return [Requirement(line) for line in (line.split("#")[0].strip() for line in lines) if line]


def test_the_test_lock_pins_every_requirement_within_its_range() -> None:
    pins = lockfile.read_pins(TEST_LOCK)
    for req in _requirements(("options", "install_requires"), ("options.extras_require", "test")):
        name = lockfile.normalised(req.name)
        assert name in pins, f"{req.name} is not in {TEST_LOCK.name}: run scripts/lock.sh"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} outside {req}"
    for line in (REPO / "requirements" / "artefacts.in").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            assert req.specifier.contains(pins[lockfile.normalised(req.name)])


def test_the_vllm_lane_lock_pins_its_inputs() -> None:
    pins = lockfile.read_pins(VLLM_LOCK)
    for line in (REPO / "requirements" / "vllm-lane.in").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            assert req.specifier.contains(pins[lockfile.normalised(req.name)], prereleases=True), req
    assert pins["torch"] == "2.13.0"


def test_the_openenv_lane_lock_pins_its_inputs() -> None:
    pins = lockfile.read_pins(REPO / "requirements" / "openenv-lane-lock.txt")
    for line in (REPO / "requirements" / "openenv-lane.in").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            req = Requirement(line)
            assert req.specifier.contains(pins[lockfile.normalised(req.name)]), req
    assert pins["mcp"].startswith("1."), pins["mcp"]  # why the lane exists: verifiers 0.4 needs mcp 2


def test_this_environment_is_the_lock() -> None:
    """What the suite runs on is what the lock says (install.sh --test applied it), torch aside where kept."""
    differ = []
    for name, version in lockfile.read_pins(TEST_LOCK).items():
        try:
            have = importlib.metadata.version(name).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            have = "missing"
        if have != version and name != "torch":
            differ.append(f"{name} {have} (lock: {version})")
    assert not differ, f"not the locked versions, install with scripts/install.sh --test: {differ}"


def _report(tmp_path: Path, items: list[dict]) -> Path:
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"install": items}))
    return path


def test_a_report_becomes_pins(tmp_path) -> None:
    report = _report(tmp_path, [
        {"metadata": {"name": "Torch", "version": "2.13.0+cpu"}, "download_info": {"url": "file:///w/torch.whl"}},
        {"metadata": {"name": "typing_extensions", "version": "4.15.0"}, "download_info": {}},
        {"metadata": {"name": "rlrun", "version": "0.1.0"},
         "download_info": {"url": "file:///repo", "dir_info": {"editable": True}}},
    ])
    assert lockfile.resolved(report) == {"torch": "2.13.0", "typing-extensions": "4.15.0"}
    written = subprocess.run([sys.executable, str(REPO / "scripts" / "lib" / "lockfile.py"), "write", str(report)],
                             capture_output=True, text=True, check=True).stdout
    assert written == "torch==2.13.0\ntyping-extensions==4.15.0\n"


def test_changes_name_each_difference(tmp_path) -> None:
    assert lockfile.changes({"a": "1", "b": "2", "c": "3", "pip": "23"}, {"a": "1", "b": "2.1", "d": "4"}) == [
        "  ~ b 2 -> 2.1", "  - c 3 (no longer installed)", "  + d 4 (not in the lock)"]
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("Foo_Bar==1.0\n-e git+https://x#egg=rlrun\nrlrun==0.1.0\n")
    assert lockfile.read_pins(freeze) == {"foo-bar": "1.0", "rlrun": "0.1.0"}


@pytest.mark.parametrize("script", ["lock.sh", "check_latest.sh"])
def test_the_scripts_parse_and_explain_themselves(script: str) -> None:
    path = REPO / "scripts" / script
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    bad = subprocess.run(["bash", str(path), "--bogus"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "unknown option" in bad.stderr
