#!/usr/bin/env bash
# Install rlrun into ./.venv (created if missing).
#   bash scripts/install.sh          # the package
#   bash scripts/install.sh --test   # + test extras (+ Slurm/munge/iproute2 when root with apt)
# torch: an already-installed torch (e.g. a CUDA build) is pinned to its own version and left
# alone; otherwise torch 2.13.0 is installed first, so pip never resolves a CUDA torch on its own.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1
PY=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
VPY=.venv/bin/python
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
if installed=$("$VPY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null); then
  echo "torch==${installed}" > "$constraints"
else
  echo "torch==${RLRUN_TORCH_VERSION:-2.13.0}" > "$constraints"
  # RLRUN_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu) picks the CPU build elsewhere.
  "$VPY" -m pip install -q -c "$constraints" ${RLRUN_TORCH_INDEX:+--index-url "$RLRUN_TORCH_INDEX"} torch
fi
extras=""
[[ $want_test == 1 ]] && extras="[test]"
"$VPY" -m pip install -q -c "$constraints" -e ".${extras}"
if [[ $want_test == 1 && -x scripts/ci/install_cluster_deps.sh ]]; then
  bash scripts/ci/install_cluster_deps.sh || echo "rlrun install: Slurm/netns tools unavailable; those tests will skip"
fi
if [[ $want_test == 1 ]]; then  # the vLLM lane (.venv-vllm): never fails the install, its tests skip loudly
  bash scripts/ci/install_vllm_lane.sh || echo "rlrun install: !!! vLLM lane (.venv-vllm) NOT installed; tests/engines vLLM tests will SKIP !!!"
fi
echo "rlrun installed in .venv (torch $("$VPY" -c 'import torch; print(torch.__version__)'))"
