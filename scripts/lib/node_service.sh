# Start, await and stop background services on this node, for the launch scripts.
#
# scripts/runpod/launch.sh sources this file. scripts/slurm/train.sh (which ppo.sh runs) reads it
# on the batch host and puts it in front of the per-node script, because the batch script's
# directory need not exist on the other nodes. The caller defines `say` (one progress line) and sets `py` (a python, used for
# the HTTP health check). Bash only; every name here starts with svc_ or node_service_ (bash
# locals are visible to the functions they call, such as the caller's `say`, which may read $log).
#
# RLRUN_NODE_SERVICE          command started once per node before training (run by bash on that
#                             node, so $SLURM_NODEID, $NODE_RANK, $(hostname) in it expand there)
# RLRUN_NODE_SERVICE_HEALTH   http(s) URL that answers 200 once the service is ready (expanded the
#                             same way); unset: the service only has to stay alive for 1 s
# RLRUN_NODE_SERVICE_WAIT     seconds to wait for the health URL (default 120)

svc_names=()    # what each started service is called in messages
svc_targets=()  # what `kill` gets to stop it: -PGID (own session) or PID

# svc_start NAME LOG CMD...: run CMD in the background, output appended to LOG; sets svc_pid.
svc_start() {
    local svc_name="$1" svc_log="$2"
    shift 2
    if command -v setsid >/dev/null 2>&1; then
        # A session of its own, so stopping it also stops whatever it started. A background child
        # of a script is no process-group leader, so setsid execs in place: $! is the service.
        setsid "$@" </dev/null >>"$svc_log" 2>&1 &
        svc_pid=$!
        svc_targets+=("-$svc_pid")
    else
        "$@" </dev/null >>"$svc_log" 2>&1 &
        svc_pid=$!
        svc_targets+=("$svc_pid")
    fi
    svc_names+=("$svc_name")
}

# svc_healthy URL: true when URL answers 200 within 2 s (no proxy: the URL is usually this node's).
svc_healthy() {
    "$py" -c 'import sys, urllib.request as u
sys.exit(u.build_opener(u.ProxyHandler({})).open(sys.argv[1], timeout=2).status != 200)' "$1" >/dev/null 2>&1
}

# svc_error MESSAGE LOG: the error line, then the last lines of the service's log. Written to stdout
# in one piece: when another node fails first, srun kills this task at any moment, and a report cut
# after its first line would hide the one line that says why. Read and written by a subshell that
# ignores srun's TERM for those few milliseconds (a TERM that came while the block was read cut it
# short); the caller's TERM trap runs when the subshell is done.
svc_error() {
    (
        trap '' TERM INT
        svc_block=$(
            say "error: $1"
            while IFS= read -r svc_line; do
                say "  | ${svc_line}"
            done < <(tail -n 12 "$2" 2>/dev/null)
        )
        printf '%s\n' "$svc_block"
    )
}

# svc_await NAME PID LOG HEALTH WAIT: returns 0 once HEALTH answers 200 (or, with HEALTH empty, once
# PID is still alive after 1 s); otherwise one error line plus the log's tail, and returns 1 as soon
# as PID exits or WAIT seconds have passed.
svc_await() {
    local svc_name="$1" svc_await_pid="$2" svc_log="$3" svc_health="$4" svc_wait="$5" svc_started=$SECONDS svc_rc
    while true; do
        [[ -z "$svc_health" ]] && sleep 1
        if ! kill -0 "$svc_await_pid" 2>/dev/null; then
            wait "$svc_await_pid"
            svc_rc=$?
            svc_error "${svc_name} exited (code ${svc_rc}) before it was up; log ${svc_log}:" "$svc_log"
            return 1
        fi
        [[ -z "$svc_health" ]] && return 0
        svc_healthy "$svc_health" && return 0
        if ((SECONDS - svc_started > svc_wait)); then  # SECONDS ticks on whole seconds: wait at least svc_wait
            svc_error "${svc_name} did not answer ${svc_health} within ${svc_wait}s; log ${svc_log}:" "$svc_log"
            return 1
        fi
        sleep 0.5
    done
}

# svc_stop_all: TERM every service started here, KILL what is left after 5 s. Safe to call twice.
svc_stop_all() {
    local svc_i svc_t
    for svc_i in "${!svc_targets[@]}"; do
        if ! kill -TERM -- "${svc_targets[svc_i]}" 2>/dev/null; then
            say "${svc_names[svc_i]} had already exited"
            continue
        fi
        for ((svc_t = 0; svc_t < 50; svc_t++)); do
            kill -0 -- "${svc_targets[svc_i]}" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL -- "${svc_targets[svc_i]}" 2>/dev/null && say "${svc_names[svc_i]} ignored SIGTERM for 5 s: killed"
        say "stopped ${svc_names[svc_i]}"
    done
    svc_names=()
    svc_targets=()
}

# node_service_check: prints what is wrong with the RLRUN_NODE_SERVICE* settings, if anything.
node_service_check() {
    if [[ -z "${RLRUN_NODE_SERVICE:-}" ]]; then
        [[ -n "${RLRUN_NODE_SERVICE_HEALTH:-}${RLRUN_NODE_SERVICE_WAIT:-}" ]] \
            && echo "RLRUN_NODE_SERVICE_HEALTH/RLRUN_NODE_SERVICE_WAIT are set but RLRUN_NODE_SERVICE (the command) is not"
        return 0
    fi
    if [[ -n "${RLRUN_NODE_SERVICE_HEALTH:-}" && ! "$RLRUN_NODE_SERVICE_HEALTH" =~ ^https?:// ]]; then
        echo "RLRUN_NODE_SERVICE_HEALTH=${RLRUN_NODE_SERVICE_HEALTH} is not an http(s) URL (e.g. http://127.0.0.1:8000/health)"
    elif [[ ! "${RLRUN_NODE_SERVICE_WAIT:-120}" =~ ^[1-9][0-9]*$ ]]; then
        echo "RLRUN_NODE_SERVICE_WAIT must be whole seconds > 0, got '${RLRUN_NODE_SERVICE_WAIT}'"
    fi
}

# node_service_up HOST LOG: start RLRUN_NODE_SERVICE on this node and wait until it is up. Returns 1
# after the error line when it exits or never answers; the caller then must not start training.
node_service_up() {
    local svc_host="$1" svc_log="$2" svc_health
    # Expanded like the command (same shell, same environment), so both can use a per-node port.
    svc_health="$(bash -c "printf '%s' \"${RLRUN_NODE_SERVICE_HEALTH:-}\"")" || svc_health=""
    if [[ -n "$svc_health" ]] && svc_healthy "$svc_health"; then
        # Else a leftover server (an earlier run's) would pass for this one while it fails to bind.
        say "error: ${svc_health} answers on ${svc_host} before the node service is started; stop what serves it (a leftover service?) or use another port"
        return 1
    fi
    echo "rlrun: node service on ${svc_host}, $(date '+%F %T'): ${RLRUN_NODE_SERVICE}" >>"$svc_log"
    svc_start "the node service on ${svc_host}" "$svc_log" bash -c "$RLRUN_NODE_SERVICE"
    echo "rlrun: node service pid ${svc_pid} on ${svc_host}" >>"$svc_log"
    say "starting the node service on ${svc_host} (pid ${svc_pid}): ${RLRUN_NODE_SERVICE}; log ${svc_log}"
    svc_await "the node service on ${svc_host}" "$svc_pid" "$svc_log" "$svc_health" "${RLRUN_NODE_SERVICE_WAIT:-120}" \
        || return 1
    say "node service is up on ${svc_host}: ${svc_health:-pid ${svc_pid} (alive after 1 s; no RLRUN_NODE_SERVICE_HEALTH)}"
}
