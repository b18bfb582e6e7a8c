"""Shared test setup: offline hub, quiet progress bars, CPU DeepSpeed accelerator; models more than one folder uses."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RLRUN_NO_PROGRESS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile rlrun's and the tests' own modules once, before any test starts a process: every rank imports them,
    and where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) each process would compile them again
    (~0.2 s of CPU per process, thousands of processes a suite). py_compile writes the caches regardless."""
    import compileall

    root = Path(__file__).resolve().parents[1]
    for folder in (root / "src", root / "tests"):
        compileall.compile_dir(folder, quiet=2, workers=1)  # a fixture that is broken on purpose stays so


@pytest.fixture(scope="session")
def long_tailed_base(tmp_path_factory: pytest.TempPathFactory) -> str:
    """helpers.save_long_tailed_base at logit 5 (at 32 tokens ~1 response in 4 reaches the cap), saved once."""
    from helpers import save_long_tailed_base

    return save_long_tailed_base(tmp_path_factory.mktemp("long_tailed"), logit=5.0)
