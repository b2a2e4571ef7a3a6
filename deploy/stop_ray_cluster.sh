#!/usr/bin/env bash
# Stop exactly the Ray nodes deploy/start_ray_cluster.sh started, and everything they started.
#
# Usage: deploy/stop_ray_cluster.sh WORK_DIR      (the start script's --work; ./fedsyn-ray)
#
# Reads WORK_DIR/pids. Each `ray start --block` runs in its own session: for each PID that is
# still `ray start` (a recycled PID is left alone) it collects the session's processes and the
# process tree (GCS, raylet, ClientApp workers), sends TERM to the workers first and the head
# last, waits up to 15 s and KILLs what is left. Nothing is matched by name, and `ray stop`
# (which stops every Ray process of the user) is not used. Logs and node state stay in WORK_DIR
# (Ray's own logs are copied to WORK_DIR/ray-logs).
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0
fi
work=${1:-./fedsyn-ray}
pidfile="$work/pids"
[[ -f "$pidfile" ]] || { echo "no $pidfile: nothing to stop"; exit 0; }

# shellcheck source=deploy/stop_lib.sh
. "$(dirname "$0")/stop_lib.sh"

# Workers first, the head (GCS) last.
mapfile -t lines < <(awk '$2 != "head"' "$pidfile"; awk '$2 == "head"' "$pidfile")
targets=()
for line in "${lines[@]}"; do
    read -r pid role _ <<< "$line"
    [[ "$pid" =~ ^[0-9]+$ ]] || continue
    if ! alive "$pid"; then echo "Ray node $role (PID $pid): not running"; continue; fi
    if ! tr '\0' ' ' < "/proc/$pid/cmdline" | grep -qE 'ray start'; then
        echo "Ray node $role (PID $pid): now another program, left alone"; continue
    fi
    sid=$(ps -o sid= -p "$pid" | tr -d ' ')
    tree=$( { descendants "$pid"; [[ "$sid" == "$pid" ]] && ps -o pid= -s "$sid"; } | tr -d ' ' | sort -un | tr '\n' ' ')
    echo "Ray node $role: stopping PID(s) $tree"
    # shellcheck disable=SC2086
    kill -TERM $tree 2>/dev/null || true
    targets+=($tree)
    for _ in $(seq 1 20); do alive "$pid" || break; sleep 0.5; done
done

kill_left_after_15s "${targets[@]}"
if [[ -f "$work/ray-tmp" ]]; then  # keep Ray's logs (raylet.out names each worker it started), drop its sockets
    ray_tmp=$(cat "$work/ray-tmp")
    [[ -d "$ray_tmp/session_latest/logs" ]] && rm -rf "$work/ray-logs" && cp -r "$ray_tmp/session_latest/logs" "$work/ray-logs"
    rm -rf "$ray_tmp" "$work/ray-tmp"
fi
mv "$pidfile" "$pidfile.stopped"
echo "stopped; the PID list is now $pidfile.stopped"
