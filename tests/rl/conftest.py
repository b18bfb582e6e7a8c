"""One run that several tests in tests/rl read: each would otherwise start the same job (~9 s on 2 cores)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import DEMO_3, RunResult, run_rlrun


@pytest.fixture(scope="session")
def demo_3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RunResult]:
    """DEMO_3 on 2 ranks, run once: (its save directory, the result). Tests read the result; test_run_explains_itself
    also redraws the report in the directory."""
    save = tmp_path_factory.mktemp("demo_3") / "run"
    return save, run_rlrun(2, DEMO_3, save)
