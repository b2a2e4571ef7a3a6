# Shared by deploy/stop_local_deployment.sh and deploy/stop_ray_cluster.sh (sourced, not run):
# find a process tree by parent PID and stop exactly those PIDs, never a process by its name.

descendants() {  # PID and all its descendants, parents first
    local pid=$1 child
    echo "$pid"
    for child in $(ps -o pid= --ppid "$pid" 2>/dev/null); do descendants "$child"; done
}

alive() { [[ -d /proc/$1 ]] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }

kill_left_after_15s() {  # PIDS...: wait up to 15 s for them to exit after TERM, then KILL the rest
    local pid left=()
    for _ in $(seq 1 30); do
        left=()
        for pid in "$@"; do alive "$pid" && left+=("$pid"); done
        [[ ${#left[@]} -eq 0 ]] && return 0
        sleep 0.5
    done
    echo "still running after 15 s, sending KILL: ${left[*]}"
    kill -KILL "${left[@]}" 2>/dev/null || true
}
