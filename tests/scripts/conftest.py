"""Fixtures for the launch-script tests: a real Slurm cluster and network-namespace "pods".

Both need root (daemons, /etc/hosts, `ip netns`) and Linux; the tools come from
scripts/ci/install_cluster_deps.sh, which the fixtures run when something is missing. When the
machine cannot provide them, the tests skip and say why. Whatever a fixture starts, its
finalizer stops, also when a test fails.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from cluster_sim import NetnsHosts, Procs, SlurmCluster, Unavailable


def _require_root_linux() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("cluster tests need Linux")
    if os.geteuid() != 0:
        pytest.skip("cluster tests need root (Slurm daemons, /etc/hosts entries, network namespaces)")


def _started(resource):
    """Start a cluster resource for a fixture, skip the test if this machine cannot provide it, and
    always stop it afterwards (also when the test fails)."""
    try:
        try:
            resource.start()
        except Unavailable as exc:
            pytest.skip(str(exc))
        yield resource
    finally:
        resource.stop()


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    """A two-node Slurm cluster on this machine (slurmctld + two slurmd, own munged), for the session."""
    _require_root_linux()
    yield from _started(SlurmCluster(tmp_path_factory.mktemp("slurm")))


@pytest.fixture
def netns(tmp_path: Path):
    """Two network-namespace hosts: headpod (10.77.0.1) and workerpod (10.77.0.2), each resolving
    headpod.runpod.internal and workerpod.runpod.internal like RunPod's global networking DNS."""
    _require_root_linux()
    yield from _started(NetnsHosts(tmp_path / "netns", hosts_lines=("10.77.0.1 headpod.runpod.internal",
                                                                    "10.77.0.2 workerpod.runpod.internal")))


@pytest.fixture
def procs():
    group = Procs()
    try:
        yield group
    finally:
        group.kill_all()
