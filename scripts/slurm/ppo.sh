#!/usr/bin/env bash
# rlrun.ppo on a Slurm allocation: scripts/slurm/train.sh with the trainer fixed to rlrun.ppo.
#
#   sbatch scripts/slurm/ppo.sh --config configs/my_run.yaml [more rlrun.ppo flags]
#   sbatch --nodes=4 --gres=gpu:8 --time=48:00:00 --partition=gpu scripts/slurm/ppo.sh ...
#   RLRUN_LAUNCH=srun sbatch scripts/slurm/ppo.sh ...      # one task per GPU, no torchrun
#
# The same as `sbatch scripts/slurm/train.sh rlrun.ppo ...` except for the #SBATCH defaults below
# (job name rlrun-ppo, job log rlrun-ppo-<job id>.out): Slurm reads #SBATCH lines only from the
# file given to sbatch, so this file keeps its own. Everything else (the RLRUN_* environment
# variables, logs, restarts, srun mode, containers, the node service) is train.sh's and documented
# there. Edit the defaults here, or override any of them on the sbatch command line; a copy of this
# file needs train.sh beside it (copy both) unless the job runs in, or is submitted from, an rlrun
# checkout.
#
#SBATCH --job-name=rlrun-ppo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:TERM@300
##SBATCH --partition=gpu
##SBATCH --account=my-account

set -euo pipefail
# The time-limit notice of a short job comes at once (see train.sh): a handler, not an ignore, so that train.sh,
# which this shell becomes, can still set its own.
trap ':' TERM

# Slurm runs a spool copy of this file, so train.sh is looked up next to the file that was submitted
# (scontrol knows its path, relative to where sbatch ran), else next to $0 (run with bash by hand),
# else in the rlrun checkout the job runs in or was submitted from.
submitted="$(scontrol show job -o "${SLURM_JOB_ID:-none}" 2>/dev/null | tr ' ' '\n' | sed -n 's/^Command=//p' | head -n 1)" || true
[[ -z "$submitted" || "$submitted" == /* ]] || submitted="${SLURM_SUBMIT_DIR:-$PWD}/${submitted}"
for train_sh in ${submitted:+"$(dirname "$submitted")/train.sh"} "$(dirname "$0")/train.sh" \
                "$PWD/scripts/slurm/train.sh" "${SLURM_SUBMIT_DIR:-$PWD}/scripts/slurm/train.sh"; do
    [[ -f "$train_sh" ]] && exec bash "$train_sh" rlrun.ppo "$@"
done
echo "rlrun: error: ppo.sh runs train.sh, which is not next to ${submitted:-$0}; copy scripts/slurm/train.sh there too, or submit from an rlrun checkout" >&2
exit 2
