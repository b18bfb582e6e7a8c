"""Lint, format and types over src/ (issue 45): ruff's lint and format check, and mypy, with the settings in
pyproject.toml. Run by README's test command, so CI runs them on every submission."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_ruff_lint_is_clean():
    out = _run("ruff", "check", "--no-cache", "src")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_ruff_format_is_clean():
    out = _run("ruff", "format", "--check", "--no-cache", "src")
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


@pytest.mark.timeout(600)
def test_mypy_is_clean(tmp_path):
    out = _run("mypy", "--cache-dir", str(tmp_path / "mypy_cache"))
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
