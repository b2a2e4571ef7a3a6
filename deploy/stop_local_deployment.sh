#!/usr/bin/env bash
# Stop exactly the processes deploy/start_local_deployment.sh started, and their children.
#
# Usage: deploy/stop_local_deployment.sh WORK_DIR      (the start script's --work; ./fedsyn-local)
#
# Reads WORK_DIR/pids ("PID ROLE NAME" lines). For each PID that is still a Flower
# process (its command line names flower-superlink or flower-supernode: a recycled PID
# is left alone) it collects the process tree first (SuperExec, flwr-serverapp,
# flwr-clientapp), then sends TERM to SuperNodes, then to the SuperLink, waits up to
# 15 s and KILLs what is left. Nothing is matched by name. The ledgers, logs and the
# SuperLink database stay in WORK_DIR.
set -euo pipefail

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0
fi
work=${1:-./fedsyn-local}
pidfile="$work/pids"
[[ -f "$pidfile" ]] || { echo "no $pidfile: nothing to stop"; exit 0; }

# shellcheck source=deploy/stop_lib.sh
. "$(dirname "$0")/stop_lib.sh"

# SuperNodes first (they stop asking for work), the SuperLink last.
mapfile -t lines < <(awk '$2 != "superlink"' "$pidfile"; awk '$2 == "superlink"' "$pidfile")
targets=()
for line in "${lines[@]}"; do
    read -r pid role node <<< "$line"
    [[ "$pid" =~ ^[0-9]+$ ]] || continue
    if ! alive "$pid"; then echo "$role $node (PID $pid): not running"; continue; fi
    if ! tr '\0' ' ' < "/proc/$pid/cmdline" | grep -qE 'flower-super(link|node|exec)'; then
        echo "$role $node (PID $pid): now another program, left alone"; continue
    fi
    tree=$(descendants "$pid" | tr '\n' ' ')
    echo "$role $node: stopping PID(s) $tree"
    # shellcheck disable=SC2086
    kill -TERM $tree 2>/dev/null || true
    targets+=($tree)
done

kill_left_after_15s "${targets[@]}"
mv "$pidfile" "$pidfile.stopped"
echo "stopped; the PID list is now $pidfile.stopped"
