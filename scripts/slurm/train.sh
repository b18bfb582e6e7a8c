#!/usr/bin/env bash
# Any rlrun trainer on a Slurm allocation: one torchrun per node (default), or one srun task per GPU.
#
#   sbatch scripts/slurm/train.sh rlrun.dpo --pretrain MODEL --dataset FILE [more rlrun.dpo flags]
#   sbatch scripts/slurm/train.sh sft --config configs/my_sft.yaml
#   sbatch --nodes=4 --gres=gpu:8 --time=48:00:00 --partition=gpu scripts/slurm/train.sh rm ...
#   RLRUN_LAUNCH=srun sbatch scripts/slurm/train.sh dpo ...   # one task per GPU, no torchrun
#   sbatch scripts/slurm/ppo.sh --config configs/my_run.yaml  # = train.sh rlrun.ppo, with ppo.sh's defaults
#   sbatch scripts/slurm/train.sh tinker --pretrain MODEL --lora_rank 32 --tinker_host 0.0.0.0  # the Tinker API
#       on the first node's port 8000 (docs/tinker.md); point the SDK's base_url at it
#
# The first argument names the trainer: rlrun.ppo, rlrun.sft, rlrun.rm, rlrun.dpo or rlrun.tinker (or just ppo,
# sft, rm, dpo, tinker). Everything after it goes to `python -m <trainer>` unchanged (or set RLRUN_CONFIG to
# a YAML file; it is passed as `--config FILE` before the other flags). Submit from the directory
# the paths in your flags are relative to (or use `sbatch --chdir DIR`); when that directory is a
# checkout of rlrun, its src/ is put on PYTHONPATH.
#
# Defaults: Slurm reads #SBATCH lines only from the file given to sbatch, so each submittable script
# carries its own block: this one below, and scripts/slurm/ppo.sh (which holds nothing else: it
# runs this file with rlrun.ppo, so all the machinery and this documentation live here). Edit a
# block, or override any line on the sbatch command line (flags there win). Partition and account
# are commented out: uncomment and fill in, or pass --partition/--account. On a cluster without GPUs
# use `sbatch --gres=none` and set RLRUN_PROCS_PER_NODE. The job is named rlrun-<trainer> (e.g.
# rlrun-dpo) once it starts, unless you gave it another --job-name; the job log is named at submission:
# rlrun-<job id>.out here (ppo.sh: rlrun-ppo-<job id>.out).
#
# Environment (all optional; sbatch passes your shell's environment to the job):
#   RLRUN_LAUNCH           torchrun (default): one elastic torchrun per node (restarts on failure);
#                          srun: one `python -m <trainer>` task per GPU, rank = SLURM_PROCID.
#   GPUS_PER_NODE          processes per node. Default: the GPUs per node the job requested
#                          (--gpus-per-node or --gres=gpu:N), else RLRUN_PROCS_PER_NODE, else the
#                          GPUs Slurm shows on the node (SLURM_GPUS_ON_NODE), else 1.
#   RLRUN_PROCS_PER_NODE   processes per node when the job requests no GPUs (CPU clusters, tests).
#   RLRUN_MAX_RESTARTS     torchrun --max-restarts (default 3): the whole job restarts together after
#                          a failure; resume from checkpoints with --load_checkpoint.
#   RLRUN_RDZV             c10d (default; elastic, restarts on any node restart all nodes) or static
#                          (--node_rank = SLURM_NODEID, so node 0 holds rank 0).
#   RLRUN_PORT             rendezvous / master port (default 20000 + job id % 20000).
#   RLRUN_HEAD_ADDR        address of the rendezvous host (default: first host of the allocation).
#   RLRUN_JOIN_TIMEOUT     seconds torchrun waits for all nodes to join (default 900).
#   RLRUN_PYTHON           python with rlrun installed (default: python, else python3, on each node).
#   RLRUN_TORCHRUN         torchrun command (default: "$RLRUN_PYTHON -m torch.distributed.run").
#   RLRUN_LOG_DIR          per-node logs (default logs/<job name>-<job id>, e.g. logs/rlrun-dpo-123);
#                          the job log itself is %x-%j.out (--output).
#   RLRUN_IB               0: NCCL_IB_DISABLE=1 (no InfiniBand); 1: NCCL_IB_DISABLE=0. Unset: NCCL decides.
#   RLRUN_SOCKET_IFNAME    network interface for NCCL and gloo (sets NCCL_SOCKET_IFNAME and
#                          GLOO_SOCKET_IFNAME unless those are set), e.g. ib0 or eth0.
#   NCCL_DEBUG             default WARN (INFO for connection debugging).
#   RLRUN_CONTAINER_IMAGE  run on the nodes inside this image with pyxis/enroot (--container-image);
#   RLRUN_CONTAINER_MOUNTS --container-mounts (default: the submit directory at the same path).
#   RLRUN_PREFLIGHT        1 (default): check the flags and role layout for the job's world size
#                          (`python -m <trainer> ... --dry_run`) on the first node before starting
#                          every node.
#   RLRUN_SRUN_ARGS        extra srun flags for the training step (word-split).
#   RLRUN_CPUS_PER_NODE    CPUs per node for the training step's tasks (default SLURM_CPUS_ON_NODE;
#                          split evenly between the tasks with RLRUN_LAUNCH=srun).
#   RLRUN_NODE_LABEL       the node label rlrun.ppo's --actor_node_label/--ref_node_label/... match (read on
#                          each node; default: the node's host name). A value exported here reaches every
#                          node alike, so to pin roles to node kinds leave it unset and name host names.
#   RLRUN_NODE_SERVICE     a command started once per node before training and stopped after it (e.g.
#                          "python -m rlrun.retriever_server --corpus_path corpus.jsonl --port 8000"); run
#                          by bash on the node ($SLURM_NODEID expands there), logged to
#                          <log dir>/node-service-<node name>.log. A node trains only once its service is up;
#                          if it exits or never answers, the job fails. With RLRUN_LAUNCH=srun local task 0
#                          starts it and the node's other tasks wait for it.
#   RLRUN_NODE_SERVICE_HEALTH  URL that answers 200 when the service is ready (e.g.
#                          http://127.0.0.1:8000/health); unset: the service just has to stay alive for 1 s.
#   RLRUN_NODE_SERVICE_WAIT    seconds to wait for RLRUN_NODE_SERVICE_HEALTH (default 120).
#   RLRUN_PREEMPT_GRACE    seconds a process may take to stop after a preemption notice (default 600): torchrun
#                          waits this long for its workers (TORCH_ELASTIC_SHUTDOWN_TIMEOUT) before killing them.
#
# Preemption and the time limit: SIGTERM or SIGUSR1 to this script (the --signal line below: TERM to the batch
# shell 5 minutes before the time limit) or to the training processes (Slurm preempting the job) asks every rank to
# finish its step, save a checkpoint and stop. The script then requeues the job (scontrol requeue: same job id, the
# same command) and the requeued job resumes from that checkpoint by itself. The checkpoint goes to --ckpt_path, so
# the run needs --save_steps > 0; the grace must cover one step and one save (the log prints both times). A
# second signal more than 10 s after the first ends the processes at once; the newest sealed checkpoint is kept.
#
#SBATCH --job-name=rlrun
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

say() { echo "rlrun: $*"; }
die() { echo "rlrun: error: $*" >&2; exit 2; }
# A notice that comes before training starts has nothing to save: say so and go on. A job whose --time is at most
# the --signal lead (300 s above) gets the time-limit notice as it starts, and the shell's default action would end
# it at once; after a preemption's notice Slurm stops the job itself. The training step's handler is set at its start.
trap 'say "TERM received before training started: nothing to save yet, going on (a --time of at most 5 minutes gets the --signal notice at once)"' TERM

# The trainer: checked before anything else, so a typo costs one line and no allocation time.
trainer="${1:-}"
case "$trainer" in
    rlrun.ppo | rlrun.sft | rlrun.rm | rlrun.dpo | rlrun.tinker) ;;
    ppo | sft | rm | dpo | tinker) trainer="rlrun.$trainer" ;;
    *) die "the first argument names the trainer: rlrun.ppo, rlrun.sft, rlrun.rm, rlrun.dpo or rlrun.tinker (or ppo, sft, rm, dpo, tinker), got '${1:-}'; e.g. sbatch scripts/slurm/train.sh rlrun.dpo --config FILE" ;;
esac
shift

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    die "not inside a Slurm job; submit with: sbatch scripts/slurm/train.sh ${trainer} --config FILE [flags]"
fi

args=()
[[ -n "${RLRUN_CONFIG:-}" ]] && args+=(--config "$RLRUN_CONFIG")
args+=("$@")
((${#args[@]})) || die "no arguments for ${trainer}; pass flags after it (e.g. --config configs/demo.yaml) or set RLRUN_CONFIG"

# The #SBATCH name above is one for all trainers; name the job after this one unless the user named
# it (squeue/sacct show the new name; the job log's file name was fixed at submission).
job_name="${SLURM_JOB_NAME:-rlrun}"
if [[ "$job_name" == rlrun ]]; then
    job_name="rlrun-${trainer#rlrun.}"
    scontrol update JobId="$SLURM_JOB_ID" JobName="$job_name" >/dev/null 2>&1 || true
fi

launch="${RLRUN_LAUNCH:-torchrun}"
[[ "$launch" == torchrun || "$launch" == srun ]] || die "RLRUN_LAUNCH=$launch; use torchrun or srun"
rdzv="${RLRUN_RDZV:-c10d}"
[[ "$rdzv" == c10d || "$rdzv" == static ]] || die "RLRUN_RDZV=$rdzv; use c10d or static"

nnodes="${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}"
nodelist="${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-$(hostname)}}"

first_host() {
    # scontrol knows Slurm's host-list syntax; the fallback handles the common "pfx[01-04,7],other".
    local first
    if first=$(scontrol show hostnames "$1" 2>/dev/null | head -n 1) && [[ -n "$first" ]]; then
        echo "$first"
        return
    fi
    local prefix="${1%%[,[]*}" rest inner
    rest="${1:${#prefix}}"
    if [[ "$rest" == "["* ]]; then
        inner="${rest#\[}"
        echo "$prefix${inner%%[],-]*}"
    else
        echo "$prefix"
    fi
}
head_addr="${RLRUN_HEAD_ADDR:-$(first_host "$nodelist")}"
port="${RLRUN_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"

gpus_requested() {
    # Per-node GPUs the job asked for (--gpus-per-node, --gres=gpu[:type]:N). SLURM_GPUS_ON_NODE
    # in the batch step can show the whole node (e.g. with --exclusive), so the request comes first.
    if [[ "${SLURM_GPUS_PER_NODE:-}" =~ ([0-9]+)$ ]]; then
        echo "${BASH_REMATCH[1]}"
        return
    fi
    local tres
    tres=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n 's/^TresPerNode=//p' | head -n 1)
    if [[ "$tres" =~ gpu(:[A-Za-z0-9_.-]+)?:([0-9]+) ]]; then
        echo "${BASH_REMATCH[2]}"
    fi
}
procs="${GPUS_PER_NODE:-$(gpus_requested)}"
if [[ -z "$procs" ]]; then
    if [[ -n "${RLRUN_PROCS_PER_NODE:-}" ]]; then
        procs="$RLRUN_PROCS_PER_NODE"
    elif [[ "${SLURM_GPUS_ON_NODE:-}" =~ ^[1-9][0-9]*$ ]]; then
        procs="$SLURM_GPUS_ON_NODE"
    else
        procs=1
    fi
fi
[[ "$procs" =~ ^[1-9][0-9]*$ ]] || die "processes per node must be a positive integer, got '$procs' (GPUS_PER_NODE / RLRUN_PROCS_PER_NODE)"
world=$((nnodes * procs))

restarts="${RLRUN_MAX_RESTARTS:-3}"
[[ "$restarts" =~ ^[0-9]+$ ]] || die "RLRUN_MAX_RESTARTS must be a non-negative integer, got '$restarts'"
join_timeout="${RLRUN_JOIN_TIMEOUT:-900}"

# Networking. NCCL_*/GLOO_* variables already in the environment win over the RLRUN_* shortcuts.
case "${RLRUN_IB:-}" in
    "") ;;
    0 | false | no | off) export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}" ;;
    1 | true | yes | on) export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-0}" ;;
    *) die "RLRUN_IB=$RLRUN_IB; use 0 (no InfiniBand) or 1" ;;
esac
if [[ -n "${RLRUN_SOCKET_IFNAME:-}" ]]; then
    export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$RLRUN_SOCKET_IFNAME}"
    export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$RLRUN_SOCKET_IFNAME}"
fi
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export PYTHONUNBUFFERED=1
grace="${RLRUN_PREEMPT_GRACE:-600}"
[[ "$grace" =~ ^[0-9]+$ ]] || die "RLRUN_PREEMPT_GRACE must be a number of seconds, got '$grace'"
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$grace}"
# Each torchrun restart round gets a fresh store for the workers (no keys left from the failed
# attempt), instead of sharing the rendezvous store across attempts.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

workdir="$PWD"
if [[ -f "$workdir/src/rlrun/__init__.py" ]]; then
    export PYTHONPATH="$workdir/src${PYTHONPATH:+:$PYTHONPATH}"
fi
log_dir="${RLRUN_LOG_DIR:-logs/${job_name}-${SLURM_JOB_ID}}"
mkdir -p "$log_dir"
log_dir="$(cd "$log_dir" && pwd)"
# Rank 0 writes this file when it stopped on a preemption notice with a checkpoint (rlrun.run.preemption): the
# processes' exit status cannot say so (torchrun reports its own).
export RLRUN_PREEMPTED_FILE="$log_dir/.preempted-${SLURM_JOB_ID}-${SLURM_RESTART_COUNT:-0}"
rm -f "$RLRUN_PREEMPTED_FILE"

srun_args=(--nodes="$nnodes" --kill-on-bad-exit=1 --label)
if [[ -n "${RLRUN_CONTAINER_IMAGE:-}" ]]; then
    srun_args+=(--container-image="$RLRUN_CONTAINER_IMAGE"
                --container-mounts="${RLRUN_CONTAINER_MOUNTS:-$workdir:$workdir}"
                --container-workdir="$workdir")
fi
if [[ -n "${RLRUN_SRUN_ARGS:-}" ]]; then
    read -r -a extra_srun <<<"$RLRUN_SRUN_ARGS"
    srun_args+=("${extra_srun[@]}")
fi
cpus_on_node="${RLRUN_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-}}"

# The per-node service's start/await/stop code goes to the nodes inside the node script (below).
svc_lib_text=""
if [[ -n "${RLRUN_NODE_SERVICE:-}${RLRUN_NODE_SERVICE_HEALTH:-}${RLRUN_NODE_SERVICE_WAIT:-}" ]]; then
    # $0 is this file when ppo.sh ran it; when this file was submitted itself, Slurm runs a spool
    # copy of it and scontrol knows the path it was submitted as (relative to where sbatch ran).
    submitted="$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n 's/^Command=//p' | head -n 1)"
    [[ -z "$submitted" || "$submitted" == /* ]] || submitted="${SLURM_SUBMIT_DIR:-$workdir}/${submitted}"
    for svc_lib in "$(dirname "$0")/../lib/node_service.sh" ${submitted:+"$(dirname "$submitted")/../lib/node_service.sh"} \
                   "$workdir/scripts/lib/node_service.sh" "${SLURM_SUBMIT_DIR:-.}/scripts/lib/node_service.sh"; do
        [[ -f "$svc_lib" ]] && break
    done
    [[ -f "$svc_lib" ]] || die "RLRUN_NODE_SERVICE needs scripts/lib/node_service.sh next to scripts/slurm/; submit the script from an rlrun checkout"
    svc_lib_text="$(<"$svc_lib")"
    # shellcheck source=../lib/node_service.sh
    source "$svc_lib"
    problem="$(node_service_check)"
    [[ -z "$problem" ]] || die "$problem"
fi

export RLRUN_NODE_PYTHON="${RLRUN_PYTHON:-}" RLRUN_NODE_TORCHRUN="${RLRUN_TORCHRUN:-}"
export RLRUN_NODE_LOG_DIR="$log_dir" RLRUN_NODE_HEAD="$head_addr" RLRUN_NODE_PORT="$port"
export RLRUN_NODE_PROCS="$procs" RLRUN_NODE_NNODES="$nnodes" RLRUN_NODE_RESTARTS="$restarts"
export RLRUN_NODE_RDZV="$rdzv" RLRUN_NODE_JOIN_TIMEOUT="$join_timeout" RLRUN_NODE_LAUNCH="$launch"
export RLRUN_NODE_TRAINER="$trainer"

say "job ${SLURM_JOB_ID} (${job_name}): python -m ${trainer} on ${nnodes} node(s) ${nodelist}, ${procs} process(es) per node, world size ${world}"
if [[ "$launch" == torchrun ]]; then
    say "launch=torchrun (rdzv ${rdzv}, max_restarts ${restarts}) head=${head_addr}:${port} workdir=${workdir}"
else
    say "launch=srun (one task per process, no restarts) head=${head_addr}:${port} workdir=${workdir}"
fi
say "logs: this file (all nodes, lines prefixed by node/task) and ${log_dir}/node-<N>.log"

# Validate flags and the role layout for this world size before starting every node (cheap: no
# torch.distributed, no model). Skipped inside containers: the batch host may have no python.
if [[ "${RLRUN_PREFLIGHT:-1}" == 1 && -z "${RLRUN_CONTAINER_IMAGE:-}" ]]; then
    py="${RLRUN_PYTHON:-$(command -v python || command -v python3 || true)}"
    [[ -n "$py" ]] || die "no python on $(hostname); set RLRUN_PYTHON to the python that has rlrun installed"
    if ! env -u SLURM_PROCID -u SLURM_STEP_ID RANK=0 LOCAL_RANK=0 WORLD_SIZE="$world" LOCAL_WORLD_SIZE="$procs" \
            "$py" -m "$trainer" "${args[@]}" --dry_run 2>&1 | tee -a "$log_dir/preflight.log"; then
        die "the flags do not validate for world size ${world} (${nnodes} x ${procs}): python -m ${trainer} --dry_run failed, see above. Nothing was started."
    fi
fi

# What runs on every node (torchrun mode) or for every task (srun mode). Passed as a string: the
# batch script itself exists only on the first node.
read -r -d '' node_script <<'NODE_SCRIPT' || true
set -uo pipefail
node="${SLURM_NODEID:-0}"
log="$RLRUN_NODE_LOG_DIR/node-${node}.log"
py="${RLRUN_NODE_PYTHON:-$(command -v python || command -v python3 || echo python)}"
say() { echo "rlrun: $*" | tee -a "$log"; }
# A preemption notice is for the training processes (Slurm signals every process of the step): this shell and the
# tee keeping the log must outlive it, or the step would end before the checkpoint. torchrun forwards the TERM it
# hears to its workers, but has no handler for USR1 (its default action would end it): it ignores USR1, which its
# workers hear from Slurm directly (rlrun installs its own handler over the inherited ignore).
trap ':' TERM USR1
keep_log() { trap '' TERM USR1; exec tee -a "$log"; }
start() { trap '' USR1; exec "$@"; }
if [[ -n "${RLRUN_NODE_SERVICE:-}" ]]; then
    # Once per node: by the node's torchrun task, or by local task 0 of the node's srun tasks. In
    # srun mode the node's tasks hand off through files in hand_off: local task 0 writes "up" once
    # the service is up, each other task writes "done-<local id>" when it ends, and local task 0
    # stops the service only after those (a task that finishes early must not cut off the others).
    host="${SLURMD_NODENAME:-$(hostname)}"
    hand_off="$RLRUN_NODE_LOG_DIR/.node-service-${host}-${SLURM_JOB_ID}.${SLURM_STEP_ID:-0}"
    if [[ "$RLRUN_NODE_LAUNCH" == torchrun || "${SLURM_LOCALID:-0}" == 0 ]]; then
        others_done() {
            local waited=0 done_files
            shopt -s nullglob
            done_files=("$hand_off"/done-*)
            while ((${#done_files[@]} < RLRUN_NODE_PROCS - 1 && waited < 1200)); do
                sleep 0.5
                waited=$((waited + 1))
                done_files=("$hand_off"/done-*)
            done
        }
        # After a clean finish, wait (up to 10 min) for the node's other tasks; after a failure or a
        # signal Slurm ends the whole step anyway.
        trap 'rc=$?; [[ $rc == 0 && "$RLRUN_NODE_LAUNCH" == srun ]] && others_done; svc_stop_all; rm -rf "$hand_off"; exit $rc' EXIT
        trap 'exit 130' INT
        node_service_up "$host" "$RLRUN_NODE_LOG_DIR/node-service-${host}.log" || exit 2
        [[ "$RLRUN_NODE_LAUNCH" == srun ]] && mkdir -p "$hand_off" && touch "$hand_off/up"
    else
        trap 'touch "$hand_off/done-${SLURM_LOCALID}" 2>/dev/null' EXIT
        waited=0
        until [[ -f "$hand_off/up" ]]; do
            # Local task 0 failing ends the step (--kill-on-bad-exit); this bound is a backstop.
            if ((waited >= ${RLRUN_NODE_SERVICE_WAIT:-120} * 2 + 30)); then
                echo "rlrun: error: task ${SLURM_PROCID:-?} on ${host}: the node service was not up after ${waited}s" | tee -a "$log"
                exit 2
            fi
            sleep 1
            waited=$((waited + 1))
        done
    fi
fi
if [[ "$RLRUN_NODE_LAUNCH" == srun ]]; then
    # One task per GPU: rlrun reads SLURM_PROCID / SLURM_STEP_* and MASTER_ADDR / MASTER_PORT.
    if [[ "${SLURM_LOCALID:-0}" == 0 ]]; then
        echo "rlrun: node ${node}/${RLRUN_NODE_NNODES} ($(hostname)) head=${MASTER_ADDR}:${MASTER_PORT}, starting ${RLRUN_NODE_PROCS} task(s): ${py} -m ${RLRUN_NODE_TRAINER}" | tee -a "$log"
    fi
    start "$py" -m "$RLRUN_NODE_TRAINER" "$@" 2>&1 | keep_log
    exit "${PIPESTATUS[0]}"
fi
if [[ -n "$RLRUN_NODE_TORCHRUN" ]]; then
    read -r -a torchrun <<<"$RLRUN_NODE_TORCHRUN"
else
    torchrun=("$py" -m torch.distributed.run)
fi
rdzv_args=(--nnodes="$RLRUN_NODE_NNODES" --nproc_per_node="$RLRUN_NODE_PROCS" --max_restarts="$RLRUN_NODE_RESTARTS")
if [[ "$RLRUN_NODE_RDZV" == static ]]; then
    rdzv_args+=(--rdzv_backend=static --node_rank="$node" --master_addr="$RLRUN_NODE_HEAD" --master_port="$RLRUN_NODE_PORT"
                --rdzv_conf="timeout=${RLRUN_NODE_JOIN_TIMEOUT}")
else
    # Node 0 hosts the rendezvous store (explicitly: guessing from host names fails when nodes share
    # an address); torchrun waits up to join_timeout for every node. Each node names itself as
    # Slurm does (not by its FQDN, which may resolve to 127.0.1.1): with a fresh worker store per
    # restart round, rank 0's node name is the workers' MASTER_ADDR.
    is_host=false
    [[ "$node" == 0 ]] && is_host=true
    rdzv_args+=(--rdzv_backend=c10d --rdzv_endpoint="$RLRUN_NODE_HEAD:$RLRUN_NODE_PORT" --rdzv_id="rlrun-${SLURM_JOB_ID}"
                --rdzv_conf="is_host=${is_host},join_timeout=${RLRUN_NODE_JOIN_TIMEOUT}")
    [[ -n "${SLURMD_NODENAME:-}" ]] && rdzv_args+=(--local_addr="$SLURMD_NODENAME")
fi
echo "rlrun: node ${node}/${RLRUN_NODE_NNODES} ($(hostname)) head=${RLRUN_NODE_HEAD}:${RLRUN_NODE_PORT}, starting torchrun with ${RLRUN_NODE_PROCS} process(es)" | tee -a "$log"
start "${torchrun[@]}" "${rdzv_args[@]}" -m "$RLRUN_NODE_TRAINER" "$@" 2>&1 | keep_log
exit "${PIPESTATUS[0]}"
NODE_SCRIPT

[[ -n "$svc_lib_text" ]] && node_script="${svc_lib_text}"$'\n'"${node_script}"

set +e
if [[ "$launch" == srun ]]; then
    export MASTER_ADDR="$head_addr" MASTER_PORT="$port"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    step=(--ntasks="$world" --ntasks-per-node="$procs")
    if [[ "$cpus_on_node" =~ ^[0-9]+$ ]] && ((cpus_on_node >= procs)); then
        step+=(--cpus-per-task=$((cpus_on_node / procs)))
    fi
    say "starting ${world} task(s) with srun"
else
    step=(--ntasks="$nnodes" --ntasks-per-node=1)
    [[ "$cpus_on_node" =~ ^[0-9]+$ ]] && step+=(--cpus-per-task="$cpus_on_node")
    say "starting one torchrun per node with srun"
fi
# The batch shell hears the time-limit notice (--signal=B:TERM@...): it passes it on to the step as USR1 (srun
# forwards USR1 to every process of the step; on TERM it would also kill the step KillWait seconds later) and
# waits on.
srun_pid=""
pass_notice() {
    say "$1 received: the training processes finish their step, save a checkpoint and stop"
    [[ -n "$srun_pid" ]] && kill -USR1 "$srun_pid" 2>/dev/null
}
trap 'pass_notice TERM' TERM
trap 'pass_notice USR1' USR1
srun "${srun_args[@]}" "${step[@]}" bash -c "$node_script" rlrun-node "${args[@]}" &
srun_pid=$!
while :; do
    wait "$srun_pid"
    rc=$?
    kill -0 "$srun_pid" 2>/dev/null || break  # a notice interrupted the wait: srun still runs
done
trap - TERM USR1
set -e
if [[ -f "$RLRUN_PREEMPTED_FILE" ]]; then
    say "training stopped on a preemption notice: $(<"$RLRUN_PREEMPTED_FILE"); requeueing job ${SLURM_JOB_ID}, which resumes from that checkpoint"
    rm -f "$RLRUN_PREEMPTED_FILE"
    scontrol requeue "$SLURM_JOB_ID" || say "scontrol requeue failed (Slurm may be requeueing the job itself); otherwise submit the same command with --load_checkpoint"
    exit 0
fi
if ((rc == 0)); then
    say "training finished (exit 0); per-node logs in ${log_dir}"
else
    say "training FAILED (exit ${rc}); per-node logs in ${log_dir}"
fi
exit "$rc"
