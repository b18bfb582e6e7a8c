#!/usr/bin/env bash
# Install what the cluster tests (tests/scripts/) need: a real Slurm (slurmctld, slurmd, client),
# munge for its authentication, and iproute2 for network-namespace "hosts".
# Idempotent: does nothing when everything is already there. Needs root (or sudo) and apt-get.
# Exit status 0 when all tools are present afterwards, 1 otherwise (the tests then skip).
set -euo pipefail

need=(slurmctld slurmd sbatch srun scontrol munged mungekey ip nsenter unshare)
packages=(slurmctld slurmd slurm-client munge iproute2 util-linux)

missing() {
    local tool
    for tool in "${need[@]}"; do
        PATH="$PATH:/usr/sbin:/sbin" command -v "$tool" >/dev/null 2>&1 || echo "$tool"
    done
}

if [[ -z "$(missing)" ]]; then
    echo "install_cluster_deps: all tools present ($(PATH="$PATH:/usr/sbin" slurmctld -V 2>/dev/null || echo slurm))"
    exit 0
fi
echo "install_cluster_deps: missing: $(missing | tr '\n' ' ')"

sudo=()
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo=(sudo -n)
    else
        echo "install_cluster_deps: not root and no password-less sudo; cannot install ${packages[*]}" >&2
        exit 1
    fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_cluster_deps: no apt-get on this machine; install ${packages[*]} by hand" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null

still="$(missing | tr '\n' ' ')"
if [[ -n "${still// /}" ]]; then
    echo "install_cluster_deps: still missing after apt-get install: $still" >&2
    exit 1
fi
echo "install_cluster_deps: installed $(PATH="$PATH:/usr/sbin" slurmctld -V 2>/dev/null || echo slurm)"
