"""Every command in README.md, docs/*.md and configs/recipes/README.md runs as written: each rlrun trainer launch
(torchrun, python -m torch.distributed.run, python -m rlrun.X) is dry-run (`--dry_run` appended) for the world
size its launcher line gives, against a hub cache holding the models and datasets it names (tests/docs/doc_env.py);
the servers' flags are parsed by the servers' own parsers; everything else is in NOT_RUN with the reason."""

from __future__ import annotations

import importlib

import pytest
from doc_env import REPO, dry_run, fake_hub, launch_of, shell_commands, split_env

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "configs" / "recipes" / "README.md"]
# argv prefix -> why this test does not run the command (a word ending in "/" matches any word starting with it)
NOT_RUN = {
    ("bash", "scripts/install.sh"): "installs packages into .venv; CI runs README's install + test line itself",
    ("python3", "-m", "venv"): "creates a virtual environment (an install step)",
    ("bash", "scripts/lock.sh"): "resolves versions against the package registry (tests/cli/test_lock.py checks the lock)",
    ("bash", "scripts/check_latest.sh"): "installs the newest releases into a scratch venv and runs checks (minutes)",
    (".venv/bin/python", "-m", "pip"): "installs packages from a registry",
    (".venv/bin/python", "-m", "pytest"): "the test suite itself",
    (".venv/bin/ruff",): "the lint and format check of src/, run by README's test command",
    (".venv/bin/mypy",): "the type check of src/, run by README's test command",
    ("export",): "sets the environment of the commands after it",
    ("sbatch",): "needs a Slurm cluster (scripts/slurm runs on a simulated one in tests/scripts/test_slurm_scripts.py)",
    ("bash", "scripts/runpod/launch.sh"): "one pod of a multi-pod job (tests/scripts/test_runpod_launch.py runs it)",
    ("bash", "examples/pipeline/run.sh"): "minutes of training (tests/supervised/test_pipeline.py runs it)",
    (".venv/bin/python", "bench/"): "a benchmark: minutes, and its numbers are what it reports",
}
SERVERS = {"rlrun.reward_server": "rlrun.rewards.server", "rlrun.retriever_server": "rlrun.serving.retriever"}


def _commands() -> list[tuple[str, str]]:
    return [(f"{doc.relative_to(REPO)}:{line}", command) for doc in DOCS
            for line, command in shell_commands(doc.read_text())]


def _not_run(argv: list[str]) -> str | None:
    for prefix, reason in NOT_RUN.items():
        if len(argv) >= len(prefix) and all(a == p or (p.endswith("/") and a.startswith(p))
                                            for a, p in zip(argv, prefix)):
            return reason
    return None


@pytest.fixture(scope="module")
def hub_env(tmp_path_factory):
    return fake_hub(tmp_path_factory.mktemp("doc_hub"))


def test_the_docs_have_commands():
    found = {where.split(":")[0] for where, _ in _commands()}
    assert {"README.md", "docs/migrating.md", "docs/cluster.md", "configs/recipes/README.md"} <= found, found


@pytest.mark.parametrize("where, command", _commands(), ids=[where for where, _ in _commands()])
def test_command_runs_as_written(where, command, hub_env):
    env, argv = split_env(command)
    launch = launch_of(argv, env)
    if launch is None and len(argv) >= 3 and argv[1] == "-m" and argv[2] in SERVERS:
        parser = importlib.import_module(SERVERS[argv[2]]).build_parser()
        parser.parse_args(argv[3:])  # an unknown or missing flag exits with argparse's message
        return
    if launch is None:
        if _not_run(argv) is None:
            pytest.fail(f"{where}: `{command}` is neither an rlrun launch nor in NOT_RUN (tests/docs/"
                        "test_doc_commands.py): make it runnable or list it there with the reason")
        pytest.skip(_not_run(argv))
    module, args, world, per_node = launch
    rc, out = dry_run(module, args, world, per_node, env={**hub_env, **env})
    assert rc == 0, f"{where}: `{command}` --dry_run exited {rc}:\n{out[-3000:]}"
    if "--help" in args:
        return
    if module == "rlrun.ppo":
        assert f"layout: {world} rank" in out, out[-2000:]
    else:
        assert f"{world} ranks" in out, out[-2000:]
