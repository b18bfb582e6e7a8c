#!/usr/bin/env bash
# The lane that tries the newest: installs the newest versions setup.cfg's ranges allow (rlrun[test], torch pinned as
# install.sh pins it) into a scratch venv, prints what changed against requirements/test-lock.txt, then runs lint,
# types and a fast subset of the tests there. Run it before each submission; when it is green, `scripts/lock.sh`
# can move the lock forward (a deliberate commit, after the whole suite passes on the new lock).
#   bash scripts/check_latest.sh                 # scratch venv .venv-latest (made anew each time)
#   bash scripts/check_latest.sh -- tests/algo   # pytest arguments after --, instead of the fast subset
# Exit status: 0 when every check passed, 1 otherwise (each check runs; a summary names the failing ones).
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${RLRUN_LATEST_VENV:-.venv-latest}
PY=${PYTHON:-python3}
# The folders of fast unit tests (config, command line, peer spellings, data, plan, RL math, scorers): minutes.
tests=(tests/algo tests/config tests/cli tests/compat tests/data tests/plan tests/rewards tests/test_package_layout.py)
if [[ ${1:-} == "--" ]]; then
  shift
  tests=("$@")
elif [[ $# -gt 0 ]]; then
  echo "check_latest: unknown option '$1' (pytest arguments go after --)" >&2
  exit 2
fi
start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV" || exit 1
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==${RLRUN_TORCH_VERSION:-2.13.0}" > "$constraints"
if ! { "$VENV/bin/python" -m pip install -q -c "$constraints" torch &&
       "$VENV/bin/python" -m pip install -q --upgrade -c "$constraints" -e ".[test]" &&
       "$VENV/bin/python" -m pip install -q --no-deps $(grep -vE '^\s*(#|$)' requirements/artefacts.in); }; then
  echo "check_latest: FAILED to install the newest versions (the resolve above says why)"
  exit 1
fi
"$VENV/bin/python" -m pip list --format=freeze 2>/dev/null > "$VENV/freeze.txt"
echo "check_latest: the newest versions the ranges allow, against requirements/test-lock.txt:"
"$PY" scripts/lib/lockfile.py diff requirements/test-lock.txt "$VENV/freeze.txt"

failed=()
check() {  # $1: name; the rest: the command
  local name=$1
  shift
  echo "check_latest: $name: $*"
  if "$@"; then echo "check_latest: $name passed"; else failed+=("$name"); echo "check_latest: $name FAILED"; fi
}
check ruff "$VENV/bin/ruff" check src
check format "$VENV/bin/ruff" format --check src
check mypy "$VENV/bin/mypy"
# (the suite's own environment check compares with the lock, which the newest versions are meant to differ from)
check pytest "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=10 -o addopts= \
  --deselect tests/cli/test_lock.py::test_this_environment_is_the_lock "${tests[@]}"
took=$(( $(date +%s) - start ))
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "check_latest: FAILED with the newest versions: ${failed[*]} (${took} s); the lock keeps CI on the locked ones"
  exit 1
fi
echo "check_latest: every check passed with the newest versions (${took} s)"
