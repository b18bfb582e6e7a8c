#!/usr/bin/env bash
# rlrun across several RunPod pods (global networking or an Instant Cluster): run this on EVERY pod.
#
#   # on the head pod (node 0):
#   NODE_RANK=0 NNODES=2 NPROC_PER_NODE=8 HEAD_POD_ID=<head pod id> \
#       bash scripts/runpod/launch.sh --config configs/my_run.yaml [more rlrun.ppo flags]
#   # on each other pod (node 1, 2, ...), same variables and flags:
#   NODE_RANK=1 NNODES=2 NPROC_PER_NODE=8 HEAD_POD_ID=<head pod id> \
#       bash scripts/runpod/launch.sh --config configs/my_run.yaml [more rlrun.ppo flags]
#
# Pods may start in any order: workers wait (with progress lines) until the head answers, then
# torchrun waits until all NNODES nodes have joined. Use the same flags and RLRUN_* variables on
# every pod. Flags after the options go to `python -m rlrun.ppo` unchanged.
#
# Options: --head / --worker (instead of NODE_RANK=0 / NODE_RANK>=1), -h/--help.
#
# Environment (Instant Cluster variables are used when present):
#   NODE_RANK        0 on the head, 1..NNODES-1 on workers            (Instant Cluster: NODE_RANK)
#   NNODES           number of pods (default NUM_NODES, else 1)        (Instant Cluster: NUM_NODES)
#   NPROC_PER_NODE   processes (GPUs) per pod (default NUM_TRAINERS, else the GPUs nvidia-smi lists, else 1)
#   HEAD_ADDR        address of the head pod; default ${HEAD_POD_ID}.runpod.internal (global
#                    networking), else PRIMARY_ADDR / MASTER_ADDR (Instant Cluster), else on the
#                    head itself ${RUNPOD_POD_ID}.runpod.internal
#   HEAD_POD_ID      the head pod's id (RunPod global networking DNS: <pod id>.runpod.internal)
#   RLRUN_PORT       rendezvous port on the head (default PRIMARY_PORT / MASTER_PORT, else 29500)
#   CKPT_DIR         outputs: --save_path and --ckpt_path default here, logs in $CKPT_DIR/logs/node-<N>.log
#                    (default /workspace/rlrun when /workspace exists, else ./runs/rlrun)
#   RLRUN_RDZV       static (default): node 0 = rank 0, so the model, metrics and reward server are
#                    all on the head; c10d: elastic rendezvous (restarts all pods together, but
#                    rank 0 is whichever pod's address sorts first)
#   RLRUN_MAX_RESTARTS  torchrun --max-restarts (default 0 with static, 3 with c10d)
#   RLRUN_WAIT_TIMEOUT  seconds workers wait for the head and torchrun waits for all pods (default 600)
#   RLRUN_SOCKET_IFNAME network interface for NCCL/gloo (default: the interface that reaches the head)
#   RLRUN_LOCAL_ADDR    this pod's address as the others reach it (c10d only; default NODE_ADDR,
#                       else ${RUNPOD_POD_ID}.runpod.internal, else the IP facing the head)
#   RLRUN_IB            0: NCCL_IB_DISABLE=1; 1: NCCL_IB_DISABLE=0; unset: NCCL decides
#   NCCL_DEBUG          default WARN
#   WANDB_API_KEY       when set, --use_wandb is added (logging from rank 0)
#   RLRUN_REWARD_SERVER 1: the head serves RLRUN_REWARD_FILE with `python -m rlrun.reward_server`
#                       on RLRUN_REWARD_PORT (default 5000), waits for its /health, and every pod
#                       trains with --remote_rm_url http://HEAD_ADDR:PORT/reward. Set
#                       RLRUN_REWARD_TOKEN (same value on every pod) to require a bearer token.
#   RLRUN_NODE_SERVICE  a command every pod starts in the background before training and stops after it
#                       (e.g. "python -m rlrun.retriever_server --corpus_path corpus.jsonl --port 8000");
#                       run by bash on the pod, logged to $CKPT_DIR/logs/node-service-<host name>.log.
#                       Training starts only once it is up; if it exits or never answers, the pod fails.
#   RLRUN_NODE_SERVICE_HEALTH  URL that answers 200 when the service is ready (e.g.
#                       http://127.0.0.1:8000/health); unset: the service just has to stay alive for 1 s
#   RLRUN_NODE_SERVICE_WAIT    seconds to wait for RLRUN_NODE_SERVICE_HEALTH (default 120)
#   RLRUN_NODE_LABEL    this pod's label, matched by --actor_node_label/--ref_node_label/... (default: the
#                       pod's host name); the one variable that may differ per pod, e.g. h100 / a100
#   RLRUN_PYTHON        python with rlrun installed (default: python, else python3)
#   RLRUN_TORCHRUN      torchrun command (default: "$RLRUN_PYTHON -m torch.distributed.run")
set -uo pipefail

say() { echo "rlrun[${NODE_RANK:-?}] $(date +%T): $*"; }
die() { echo "rlrun[${NODE_RANK:-?}]: error: $*" >&2; exit 2; }
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

role=""
args=()
while (($#)); do
    case "$1" in
        --head) role="head" ;;
        --worker) role=worker ;;
        -h | --help) usage; exit 0 ;;
        *) args+=("$1") ;;
    esac
    shift
done

NNODES="${NNODES:-${NUM_NODES:-1}}"
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || die "NNODES must be a positive integer, got '$NNODES'"
if [[ -z "${NODE_RANK:-}" ]]; then
    case "$role" in
        head) NODE_RANK=0 ;;
        worker) ;;
        *) ((NNODES == 1)) && NODE_RANK=0 || die "set NODE_RANK (0 on the head, 1..$((NNODES - 1)) on workers), or pass --head / --worker" ;;
    esac
fi
if [[ -n "${NODE_RANK:-}" ]]; then
    [[ "$NODE_RANK" =~ ^[0-9]+$ ]] && ((NODE_RANK < NNODES)) || die "NODE_RANK=$NODE_RANK must be 0..$((NNODES - 1)) (NNODES=$NNODES)"
    if [[ -z "$role" ]]; then if ((NODE_RANK == 0)); then role="head"; else role="worker"; fi; fi
    [[ "$role" == head && "$NODE_RANK" != 0 ]] && die "--head with NODE_RANK=$NODE_RANK; the head is NODE_RANK=0"
    [[ "$role" == worker && "$NODE_RANK" == 0 ]] && die "--worker with NODE_RANK=0; workers are NODE_RANK 1..$((NNODES - 1))"
fi

rdzv="${RLRUN_RDZV:-static}"
[[ "$rdzv" == static || "$rdzv" == c10d ]] || die "RLRUN_RDZV=$rdzv; use static or c10d"
if [[ "$rdzv" == static && -z "${NODE_RANK:-}" ]]; then
    die "static rendezvous needs NODE_RANK on workers (1..$((NNODES - 1))); set it, or use RLRUN_RDZV=c10d"
fi
node_label="${NODE_RANK:-$(hostname)}"

py="${RLRUN_PYTHON:-$(command -v python || command -v python3 || true)}"
[[ -n "$py" ]] || die "no python found; set RLRUN_PYTHON to the python that has rlrun installed"
if [[ -n "${RLRUN_NODE_SERVICE:-}${RLRUN_NODE_SERVICE_HEALTH:-}${RLRUN_NODE_SERVICE_WAIT:-}" || "${RLRUN_REWARD_SERVER:-0}" == 1 ]]; then
    svc_lib="$(dirname "${BASH_SOURCE[0]}")/../lib/node_service.sh"
    # shellcheck source=../lib/node_service.sh
    [[ -f "$svc_lib" ]] && source "$svc_lib" || die "missing ${svc_lib} (start, await and stop of services); run launch.sh from an rlrun checkout"
    problem="$(node_service_check)"
    [[ -z "$problem" ]] || die "$problem"
fi
if [[ -n "${RLRUN_TORCHRUN:-}" ]]; then
    read -r -a torchrun <<<"$RLRUN_TORCHRUN"
else
    torchrun=("$py" -m torch.distributed.run)
fi

if [[ -n "${NPROC_PER_NODE:-}" ]]; then
    nproc="$NPROC_PER_NODE"
elif [[ -n "${NUM_TRAINERS:-}" ]]; then
    nproc="$NUM_TRAINERS"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    nproc="$(nvidia-smi -L | grep -c '^GPU')"
else
    nproc=1
fi
[[ "$nproc" =~ ^[1-9][0-9]*$ ]] || die "NPROC_PER_NODE must be a positive integer, got '$nproc'"

if [[ -n "${HEAD_ADDR:-}" ]]; then
    head="$HEAD_ADDR"
elif [[ -n "${HEAD_POD_ID:-}" ]]; then
    head="${HEAD_POD_ID}.runpod.internal"
elif [[ -n "${PRIMARY_ADDR:-${MASTER_ADDR:-}}" ]]; then
    head="${PRIMARY_ADDR:-$MASTER_ADDR}"
elif [[ "$role" == head && -n "${RUNPOD_POD_ID:-}" ]]; then
    head="${RUNPOD_POD_ID}.runpod.internal"
elif ((NNODES == 1)); then
    head=127.0.0.1
else
    die "no head address: set HEAD_POD_ID (the head pod's id) or HEAD_ADDR on every pod"
fi
port="${RLRUN_PORT:-${PRIMARY_PORT:-${MASTER_PORT:-29500}}}"
[[ "$port" =~ ^[0-9]+$ ]] || die "RLRUN_PORT must be a port number, got '$port'"
wait_timeout="${RLRUN_WAIT_TIMEOUT:-600}"
[[ "$wait_timeout" =~ ^[0-9]+$ ]] || die "RLRUN_WAIT_TIMEOUT must be whole seconds, got '$wait_timeout'"
if [[ "$rdzv" == static ]]; then restarts="${RLRUN_MAX_RESTARTS:-0}"; else restarts="${RLRUN_MAX_RESTARTS:-3}"; fi
[[ "$restarts" =~ ^[0-9]+$ ]] || die "RLRUN_MAX_RESTARTS must be a non-negative integer, got '$restarts'"

if [[ -z "${CKPT_DIR:-}" ]]; then
    if [[ -d /workspace && -w /workspace ]]; then CKPT_DIR=/workspace/rlrun; else CKPT_DIR="$PWD/runs/rlrun"; fi
fi
mkdir -p "$CKPT_DIR/logs" || die "cannot create $CKPT_DIR/logs"
CKPT_DIR="$(cd "$CKPT_DIR" && pwd)"
log="$CKPT_DIR/logs/node-${node_label}.log"
exec > >(tee -a "$log") 2>&1
tee_pid=$!
say "$(date +%F) on $(hostname): ${role} of ${NNODES} pod(s), ${nproc} process(es) per pod, head ${head}:${port}, rdzv ${rdzv}, log ${log}"

# ---------------------------------------------------------------------------------------------
resolve() {  # first IPv4 address of a name (or the address itself)
    "$py" - "$1" <<'PY' 2>/dev/null
import socket, sys
try:
    print(socket.getaddrinfo(sys.argv[1], None, socket.AF_INET)[0][4][0])
except OSError:
    sys.exit(1)
PY
}
port_open() {
    "$py" - "$1" "$2" <<'PY' 2>/dev/null
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
except OSError:
    sys.exit(1)
PY
}
iface_for() {  # the interface that owns, or routes to, an IPv4 address
    command -v ip >/dev/null 2>&1 || return 0
    local dev
    dev="$(ip -o -4 addr show 2>/dev/null | awk -v ip="$1" '{split($4, a, "/"); if (a[1] == ip) {print $2; exit}}')"
    [[ -n "$dev" ]] || dev="$(ip -o route get "$1" 2>/dev/null | sed -n 's/.* dev \([^ ]*\).*/\1/p')"
    [[ "$dev" == lo ]] || echo "$dev"
}
src_for() {
    command -v ip >/dev/null 2>&1 || return 0
    ip -o route get "$1" 2>/dev/null | sed -n 's/.* src \([^ ]*\).*/\1/p'
}
has_children() {
    if command -v pgrep >/dev/null 2>&1; then pgrep -P "$1" >/dev/null; return; fi
    local stat
    for stat in /proc/[0-9]*/stat; do
        [[ "$(cut -d')' -f2 "$stat" 2>/dev/null | awk '{print $2}')" == "$1" ]] && return 0
    done
    return 1
}

children=()
cleanup() {
    local pid
    for pid in "${children[@]}"; do
        kill "$pid" 2>/dev/null
    done
    # The reward server and the node service: after training, also on failure or a signal.
    declare -F svc_stop_all >/dev/null && svc_stop_all
    # Give tee (up to 5 s) to write the last lines to the log before this script is gone.
    exec 1>&- 2>&-

    for _ in {1..50}; do
        kill -0 "$tee_pid" 2>/dev/null || break
        sleep 0.1
    done
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# Wait for the head's name to resolve (pod DNS can lag) and, on workers, for its port to answer.
started=$SECONDS
next_report=0
head_ip=""
while true; do
    elapsed=$((SECONDS - started))
    head_ip="$(resolve "$head")" || head_ip=""
    if [[ -n "$head_ip" ]]; then
        [[ "$role" == head ]] && break
        port_open "$head_ip" "$port" && break
        what="waiting for head ${head}:${port}"
    else
        what="waiting for ${head} to resolve"
    fi
    ((elapsed >= wait_timeout)) && die "${what}: gave up after ${wait_timeout}s (RLRUN_WAIT_TIMEOUT). Is the head pod running launch.sh with NODE_RANK=0, and is HEAD_POD_ID/HEAD_ADDR right?"
    if ((elapsed >= next_report)); then
        say "${what} (${elapsed}s/${wait_timeout}s)"
        next_report=$((elapsed + 10))
    fi
    sleep 1
done
[[ "$role" == worker ]] && say "head ${head}:${port} answers (after $((SECONDS - started))s)"

# Networking: NCCL/gloo on the interface that faces the head, unless told otherwise.
ifname="${RLRUN_SOCKET_IFNAME:-}"
if [[ -z "$ifname" && "$head_ip" != 127.* ]]; then
    ifname="$(iface_for "$head_ip")"
fi
if [[ -n "$ifname" ]]; then
    export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$ifname}"
    export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$ifname}"
fi
case "${RLRUN_IB:-}" in
    "") ;;
    0 | false | no | off) export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-1}" ;;
    1 | true | yes | on) export NCCL_IB_DISABLE="${NCCL_IB_DISABLE:-0}" ;;
    *) die "RLRUN_IB=$RLRUN_IB; use 0 or 1" ;;
esac
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
export PYTHONUNBUFFERED=1
say "network: head ${head} = ${head_ip}, NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-<NCCL default>} GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-<default>}"

# Flags every pod passes to rlrun.ppo (must be identical on all pods).
has_flag() {
    local flag
    for flag in "${args[@]}"; do
        [[ "$flag" == "$1" || "$flag" == "$1="* ]] && return 0
    done
    return 1
}
train_args=("${args[@]}")
has_flag --save_path || train_args+=(--save_path "$CKPT_DIR")
has_flag --ckpt_path || train_args+=(--ckpt_path "$CKPT_DIR/checkpoints")
if [[ -n "${WANDB_API_KEY:-}" ]] && ! has_flag --use_wandb; then
    train_args+=(--use_wandb)
    say "WANDB_API_KEY is set: logging to wandb"
fi

if [[ "${RLRUN_REWARD_SERVER:-0}" == 1 ]]; then
    reward_port="${RLRUN_REWARD_PORT:-5000}"
    reward_url="http://${head}:${reward_port}/reward"
    has_flag --remote_rm_url && die "RLRUN_REWARD_SERVER=1 sets --remote_rm_url; do not pass it too"
    train_args+=(--remote_rm_url "$reward_url")
    if [[ "$role" == head ]]; then
        [[ -n "${RLRUN_REWARD_FILE:-}" && -f "${RLRUN_REWARD_FILE}" ]] \
            || die "RLRUN_REWARD_SERVER=1 needs RLRUN_REWARD_FILE, a .py file with reward_func (got '${RLRUN_REWARD_FILE:-}')"
        reward_log="$CKPT_DIR/logs/reward-server.log"
        say "starting the reward server on port ${reward_port} (${RLRUN_REWARD_FILE}); log ${reward_log}"
        svc_start "the reward server" "$reward_log" \
            "$py" -m rlrun.reward_server --reward_file "$RLRUN_REWARD_FILE" --host 0.0.0.0 --port "$reward_port"
        svc_await "the reward server" "$svc_pid" "$reward_log" "http://127.0.0.1:${reward_port}/health" \
            "${RLRUN_REWARD_WAIT:-120}" || exit 2
        say "reward server is up: ${reward_url}"
    fi
fi

# The per-node service (e.g. a retrieval server): on every pod, up before this pod trains.
if [[ -n "${RLRUN_NODE_SERVICE:-}" ]]; then
    [[ -n "${NODE_RANK:-}" ]] && export NODE_RANK
    node_service_up "$(hostname)" "$CKPT_DIR/logs/node-service-$(hostname).log" || exit 2
fi

# torchrun: one agent per pod.
rdzv_args=(--nnodes="$NNODES" --nproc_per_node="$nproc" --max_restarts="$restarts")
if [[ "$rdzv" == static ]]; then
    rdzv_args+=(--rdzv_backend=static --node_rank="$NODE_RANK" --master_addr="$head" --master_port="$port"
                --rdzv_conf="timeout=${wait_timeout}")
else
    # Fresh worker store per restart round; every pod advertises an address the others can reach
    # (it is the master address when this pod gets rank 0).
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
    if [[ "$role" == head ]]; then
        local_addr="${RLRUN_LOCAL_ADDR:-$head}"
        is_host=true
    else
        local_addr="${RLRUN_LOCAL_ADDR:-${NODE_ADDR:-}}"
        [[ -z "$local_addr" && -n "${RUNPOD_POD_ID:-}" ]] && local_addr="${RUNPOD_POD_ID}.runpod.internal"
        [[ -z "$local_addr" ]] && local_addr="$(src_for "$head_ip")"
        is_host=false
    fi
    rdzv_args+=(--rdzv_backend=c10d --rdzv_endpoint="${head}:${port}" --rdzv_id="${RLRUN_RUN_ID:-rlrun}"
                --rdzv_conf="is_host=${is_host},join_timeout=${wait_timeout}")
    [[ -n "$local_addr" ]] && rdzv_args+=(--local_addr="$local_addr")
fi
say "starting torchrun: ${NNODES} pod(s) x ${nproc} process(es), max restarts ${restarts}"
"${torchrun[@]}" "${rdzv_args[@]}" -m rlrun.ppo "${train_args[@]}" &
torchrun_pid=$!
children+=("$torchrun_pid")

# torchrun starts its workers only once every pod has joined: report until then.
started=$SECONDS
next_report=15
while kill -0 "$torchrun_pid" 2>/dev/null; do
    if has_children "$torchrun_pid"; then
        say "all ${NNODES} pod(s) joined; training is running"
        break
    fi
    if ((SECONDS - started >= next_report)); then
        say "waiting for all ${NNODES} pod(s) to join at ${head}:${port} ($((SECONDS - started))s/${wait_timeout}s)"
        next_report=$((next_report + 15))
    fi
    sleep 1
done
wait "$torchrun_pid"
rc=$?
if ((rc == 0)); then
    say "training finished (exit 0); outputs in ${CKPT_DIR} (the final model is written by rank 0)"
else
    say "training FAILED (exit ${rc}); see ${log} and the other pods' logs"
fi
exit "$rc"
