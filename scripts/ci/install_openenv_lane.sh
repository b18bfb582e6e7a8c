#!/usr/bin/env bash
# Install the OpenEnv CI lane: a separate venv ./.venv-openenv with openenv (requirements/openenv-lane.in) at the
# versions of requirements/openenv-lane-lock.txt (scripts/lock.sh). It holds the environment side of the tests
# (OpenEnv servers, OpenEnv's validate_llm); rlrun is not installed there. It cannot share ./.venv with verifiers
# 0.4 (mcp==2.0.0 against openenv 0.10's mcp<2).
# Idempotent: does nothing when .venv-openenv already has the locked openenv.
# Exit status 0 when the lane is usable afterwards, 1 otherwise (the OpenEnv tests then skip, loudly).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-openenv
VERSION=$(sed -n 's/^openenv==//p' requirements/openenv-lane.in)
PY=${PYTHON:-python3}
start=$(date +%s)
if [[ -x $VENV/bin/python ]] && have=$($VENV/bin/python -c \
        'import importlib.metadata as m; print(m.version("openenv"))' 2>/dev/null) && [[ $have == "$VERSION" ]]; then
    echo "install_openenv_lane: $VENV ready (openenv $have)"
    exit 0
fi
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
$VENV/bin/python -m pip install -q -c requirements/openenv-lane-lock.txt -r requirements/openenv-lane.in
$VENV/bin/python -c 'import openenv.core.harness.capture.validate_llm, uvicorn; import importlib.metadata as m; print("install_openenv_lane: openenv", m.version("openenv"))'
echo "install_openenv_lane: done in $(( $(date +%s) - start )) s"
