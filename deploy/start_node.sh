#!/usr/bin/env bash
# Start this institution's SuperNode behind its FAB gate: the node side of a fedsyn deployment.
#
# Usage: deploy/start_node.sh --superlink HOST:PORT --node-config '...' --allow-list FILE [options]
#
#   --superlink HOST:PORT   the operator's SuperLink
#   --node-config '...'     this node's policy: tier, data-path, state-dir, epsilon, ... (docs/deployment.md)
#   --allow-list FILE       the FABs this node runs: fedsyn node approve CHECKOUT --allow-list FILE
#   --work DIR              the gate, FLWR_HOME, logs and pids (default ./fedsyn-node)
#   --run-as USER           run every ClientApp as USER (process isolation: flower-superexec started
#                           as USER, who must own and be able to write none of the gate, the allow-list,
#                           the approved trees or the venv; node-check checks it). As root. A state-dir
#                           or audit-dir that does not exist yet is created, owned by USER, mode 700.
#   --same-user             no --run-as: ClientApps run as you, who own the gate; accept that the
#                           approved app could change it (node-check refuses this without the flag)
#   --root-certificates CA  TLS to the SuperLink with this CA certificate (else --insecure)
#   --auth-key KEY          SuperNode authentication: this node's private key
#   --port P                this SuperNode's Runtime API port, on 127.0.0.1 (default: free)
#   --check-only            steps 1 and 2 only (the gate, the folders, node-check as the ClientApps
#                           will run), start nothing: exit 0 when the node could start, else 1
#   --foreground            stay in the foreground, the processes' output on stdout, for a service manager
#                           (fedsyn node service writes the systemd unit): TERM stops them and exits 0;
#                           when one of them exits the other is stopped and this exits 1 (the unit's
#                           Restart=on-failure starts it again, node-check first). No WORK/pids.
#
# What it does, in order, and stops at the first problem with one line:
#  1. writes the gate WORK/gate/: one launcher per task process Flower's SuperExec starts
#     (flwr-clientapp gated, flwr-agentapp refusing every FAB, the others exiting before they
#     connect) and flower-supernode (Flower's, reading no FAB that is not approved or over the
#     bounds; fedsyn_client/fab_gate.py, the allow-list's path fixed in each) and makes them and
#     the allow-list writable by their owner only. The allow-list's approved trees
#     (FILE.apps/, written by `fedsyn node approve`) are the only app code a ClientApp imports;
#  2. runs `fedsyn node-check` with the gate first in PATH (as USER with --run-as): the policy,
#     the data, the models it allows, the ledger, every launcher, the allow-list and its trees,
#     Flower's exact version, and that the ClientApp user can change none of them nor the venv;
#  3. starts flower-supernode through the gate's launcher, with that PATH; with --run-as in process isolation, and
#     flower-superexec as USER, so ClientApps run as USER and pass through the gate.
# Writes WORK/pids ("PID ROLE NAME"); deploy/stop_local_deployment.sh WORK stops exactly those.
# With --foreground it writes no pids and returns only when the node stops.
# Flower's and fedsyn's binaries come from FLWR_BIN (a folder) or PATH.
set -euo pipefail
umask 022  # the gate and the ClientApp's home must be readable by the ClientApp user (a service may start us at 077)

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
[[ $# -ge 1 && "$1" != "-h" && "$1" != "--help" ]] || { usage; [[ $# -ge 1 ]] && exit 0 || exit 2; }

superlink=""; node_config=""; allow_list=""; work=./fedsyn-node; run_as=""; ca=""; auth_key=""; port=""; same_user=""; foreground=""; check_only=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --superlink) superlink=$2; shift 2 ;;
        --node-config) node_config=$2; shift 2 ;;
        --allow-list) allow_list=$2; shift 2 ;;
        --work) work=$2; shift 2 ;;
        --run-as) run_as=$2; shift 2 ;;
        --same-user) same_user=--same-user; shift ;;
        --root-certificates) ca=$2; shift 2 ;;
        --auth-key) auth_key=$2; shift 2 ;;
        --port) port=$2; shift 2 ;;
        --foreground) foreground=1; shift ;;
        --check-only) check_only=1; shift ;;
        *) echo "error: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done
die() { echo "error: $*" >&2; exit 1; }
[[ -n "$superlink" && -n "$node_config" && -n "$allow_list" ]] || die "--superlink, --node-config and --allow-list are required"
[[ -n "$run_as" && -n "$same_user" ]] && die "--run-as and --same-user exclude each other"
[[ -f "$allow_list" ]] || die "$allow_list does not exist: approve the reviewed app first (fedsyn node approve CHECKOUT --allow-list $allow_list)"
allow_list=$(cd "$(dirname "$allow_list")" && pwd)/$(basename "$allow_list")

if [[ -n "${FLWR_BIN:-}" ]]; then bin_dir=$FLWR_BIN; else
    command -v flower-supernode > /dev/null || die "flower-supernode is not on PATH; set FLWR_BIN to the node venv's bin folder"
    bin_dir=$(dirname "$(command -v flower-supernode)")
fi
for b in flower-supernode flower-superexec fedsyn python; do
    [[ -x "$bin_dir/$b" ]] || die "$bin_dir/$b not found (set FLWR_BIN to the node venv's bin folder)"
done
mkdir -p "$work"
work=$(cd "$work" && pwd)
if [[ -n "$run_as" ]]; then
    [[ $(id -u) == 0 ]] || die "--run-as needs root (it starts flower-superexec as $run_as)"
    id "$run_as" > /dev/null 2>&1 || die "no user $run_as"
    # the ClientApp user's home: the FABs it unpacks and the model cache, nothing else of its own
    home="$work/clientapp-home"
    mkdir -p "$home" && chown "$run_as" "$home" && chmod 700 "$home"
    as_user() { runuser -u "$run_as" -- env HOME="$home" "$@"; }
    as_user "$bin_dir/python" -c "" 2> /dev/null || die "$run_as cannot run $bin_dir/python (it resolves to \
$(readlink -f "$bin_dir/python"), under a folder $run_as cannot enter or read): build the node's venv from a Python \
every user can run (e.g. /usr/bin/python3 -m venv /opt/fedsyn-node) and set FLWR_BIN to its bin folder"
    # the folders the ClientApps write (state-dir: ledger, view, snapshot; audit-dir): a new one is made
    # theirs; an existing one is left as it is, and node-check below says if they cannot write it
    folders=$(as_user "$bin_dir/fedsyn" node folders --node-config "$node_config" 2> "$work/folders.err") \
        || die "$(tail -1 "$work/folders.err")"
    while read -r folder; do
        [[ -z "$folder" || -e "$folder" ]] || install -d -o "$run_as" -g "$(id -g "$run_as")" -m 700 "$folder"
    done <<< "$folders"
else
    as_user() { "$@"; }
fi
pidfile="$work/pids"
if [[ -n "$foreground" || -n "$check_only" ]]; then pidfile=/dev/null
elif [[ -s "$pidfile" ]]; then
    while read -r pid _; do [[ -d /proc/$pid ]] && die "$pidfile lists running PID $pid; stop it first"; done < "$pidfile"
fi
: > "$pidfile"

# 1. the gate: owned by whoever runs this script, writable by nobody else
"$bin_dir/fedsyn" node install-launcher "$work/gate" --allow-list "$allow_list" > /dev/null
chmod go-w "$work/gate" "$work/gate"/* "$allow_list"
export PATH="$work/gate:$bin_dir:$PATH"
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1} TOKENIZERS_PARALLELISM=false

# 2. the start-up check, as the ClientApps will run
# the node's own logs name counts and paths: the operator's to read, no other user's
private_log() { (umask 077; : > "$1"); }
private_log "$work/node-check.log"
as_user env PATH="$PATH" "$bin_dir/fedsyn" node-check --node-config "$node_config" $same_user > "$work/node-check.log" 2>&1 \
    || { cat "$work/node-check.log" >&2; die "the node cannot start (above)"; }
cat "$work/node-check.log"
[[ -z "$check_only" ]] || exit 0

# 3. the SuperNode (and, with --run-as, its SuperExec as the ClientApp user)
port=${port:-$("$bin_dir/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
args=(--superlink "$superlink" --port "$port" --node-config "$node_config")
if [[ -n "$ca" ]]; then args+=(--root-certificates "$ca"); else args+=(--insecure); fi
[[ -n "$auth_key" ]] && args+=(--auth-supernode-private-key "$auth_key")
[[ -n "$run_as" ]] && args+=(--isolation process)
mkdir -p "$work/flwr-home"
children=()
launch() {  # ROLE NAME LOG COMMAND...: COMMAND in the background (with --foreground, its output on ours)
    local role=$1 name=$2 log=$3; shift 3
    if [[ -n "$foreground" ]]; then "$@" < /dev/null & else private_log "$log"; nohup "$@" > "$log" 2>&1 < /dev/null & fi
    children+=("$!")
    echo "$! $role $name" >> "$pidfile"
}
# the gate's flower-supernode: Flower's own, with its FAB reads behind the gate (bounds, allow-list)
launch supernode node "$work/supernode.log" env FLWR_HOME="$work/flwr-home" "$work/gate/flower-supernode" "${args[@]}"
echo "SuperNode  PID ${children[0]}  runtime API 127.0.0.1:$port  log $work/supernode.log"
if [[ -n "$run_as" ]]; then
    # No --parent-pid: Flower's check (os.kill(pid, 0)) takes another user's process for a dead one.
    # The stop script (or, in the foreground, this script) stops this SuperExec by its PID with the SuperNode.
    launch superexec "$run_as" "$work/superexec.log" runuser -u "$run_as" -- env HOME="$home" PATH="$PATH" \
        FLWR_HOME="$home/flwr" "$bin_dir/flower-superexec" --insecure --runtime-api-address "127.0.0.1:$port"
    echo "SuperExec  PID ${children[1]}  ClientApps run as $run_as behind the gate in $work/gate  log $work/superexec.log"
fi
if [[ -z "$foreground" ]]; then
    echo "Stop it: $(dirname "$0")/stop_local_deployment.sh $work"
    exit 0
fi

# --foreground: this shell is the service's main process. Its children's trees are stopped by PID
# (never by name) on TERM, or when one of them exits, so that nothing outlives the node.
# shellcheck source=deploy/stop_lib.sh
. "$(dirname "$0")/stop_lib.sh"
stop_children() {
    local tree=() pid
    for pid in "${children[@]}"; do mapfile -t -O "${#tree[@]}" tree < <(descendants "$pid"); done
    kill -TERM "${tree[@]}" 2> /dev/null || true
    kill_left_after_15s "${tree[@]}"
}
trap 'echo "stopping the node"; stop_children; exit 0' TERM INT
wait -n "${children[@]}" && status=0 || status=$?
trap - TERM INT
echo "error: a node process exited (status $status); stopping the rest, exit 1 (a service manager restarts it)" >&2
stop_children
exit 1
