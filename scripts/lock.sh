#!/usr/bin/env bash
# Refresh the locks of resolved versions that `scripts/install.sh --test` (and so CI) installs:
#   requirements/test-lock.txt       .venv: rlrun[test] (setup.cfg) and the data packages (requirements/artefacts.in)
#   requirements/vllm-lane-lock.txt  .venv-vllm: requirements/vllm-lane.in (scripts/ci/install_vllm_lane.sh)
#   requirements/openenv-lane-lock.txt  .venv-openenv: requirements/openenv-lane.in (scripts/ci/install_openenv_lane.sh)
# Each is a clean resolve: pip's own resolver in an empty scratch venv (`pip install --dry-run --report`), under
# the torch pin install.sh uses (torch==2.13.0, RLRUN_TORCH_VERSION). Nothing is installed.
# A refresh is a deliberate commit: install from the new lock in a fresh clone and run README's whole test command
# before committing it (scripts/check_latest.sh shows what a refresh would change, and tries it quickly).
#   bash scripts/lock.sh            # rewrite both locks
#   bash scripts/lock.sh --check    # resolve, compare with the committed locks, change nothing
set -euo pipefail
cd "$(dirname "$0")/.."
check=0
case "${1:-}" in
  "") ;;
  --check) check=1 ;;
  -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "rlrun lock: unknown option '$1' (options: --check)" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$PY" -m venv "$scratch/venv"
pip=("$scratch/venv/bin/python" -m pip install --dry-run --quiet --ignore-installed)
echo "torch==${RLRUN_TORCH_VERSION:-2.13.0}" > "$scratch/torch.txt"
artefacts=$(grep -vE '^\s*(#|$)' requirements/artefacts.in)

"${pip[@]}" --report "$scratch/test.json" -c "$scratch/torch.txt" -e ".[test]"
# shellcheck disable=SC2086 - one requirement per word
"${pip[@]}" --report "$scratch/artefacts.json" --no-deps $artefacts
"${pip[@]}" --report "$scratch/vllm.json" -c "$scratch/torch.txt" -r requirements/vllm-lane.in -e .
"${pip[@]}" --report "$scratch/openenv.json" -r requirements/openenv-lane.in

header() {  # $1: what the lock is for
  echo "# $1"
  echo "# Written by scripts/lock.sh from a clean resolve on $(date -u +%Y-%m-%d) (Python $("$PY" -c 'import platform; print(platform.python_version(), platform.machine())')):"
  echo "# pip reads it as a constraints file; refresh it with scripts/lock.sh, then run the whole suite before committing."
}
{
  header "The versions scripts/install.sh --test installs into .venv (rlrun[test] + requirements/artefacts.in)."
  "$PY" scripts/lib/lockfile.py write "$scratch/test.json" "$scratch/artefacts.json"
} > "$scratch/test-lock.txt"
{
  header "The versions scripts/ci/install_vllm_lane.sh installs into .venv-vllm (requirements/vllm-lane.in)."
  "$PY" scripts/lib/lockfile.py write "$scratch/vllm.json"
} > "$scratch/vllm-lane-lock.txt"
{
  header "The versions scripts/ci/install_openenv_lane.sh installs into .venv-openenv (requirements/openenv-lane.in)."
  "$PY" scripts/lib/lockfile.py write "$scratch/openenv.json"
} > "$scratch/openenv-lane-lock.txt"

status=0
for lock in test-lock.txt vllm-lane-lock.txt openenv-lane-lock.txt; do
  if [[ -f requirements/$lock ]]; then
    echo "requirements/$lock against a fresh resolve:"
    "$PY" scripts/lib/lockfile.py diff "requirements/$lock" "$scratch/$lock"
    "$PY" scripts/lib/lockfile.py diff "requirements/$lock" "$scratch/$lock" | grep -q '(nothing' || status=1
  fi
  [[ $check == 1 ]] || cp "$scratch/$lock" "requirements/$lock"
done
if [[ $check == 1 ]]; then
  exit $status
fi
echo "rlrun lock: wrote requirements/test-lock.txt, vllm-lane-lock.txt and openenv-lane-lock.txt; run the whole suite on them before committing"
