#!/usr/bin/env bash
# Try a real fedsyn deployment on one machine: one SuperLink and one SuperNode per data
# file, all on loopback (127.0.0.1), each with its own FLWR_HOME as if on its own host.
#
# Usage: deploy/start_local_deployment.sh DATA_DIR [options]
#        deploy/start_local_deployment.sh --example [options]
#
#   DATA_DIR        a folder of .csv/.jsonl/.parquet files; one SuperNode per file (its
#                   name is the file's stem), with the run's text and control columns
#   --example       no data of your own: three nodes (clinic_b strong, hospital_a and practice_c
#                   weak) on 30 disjoint BBC News articles each (text, topic; from the shipped
#                   corpus), written to WORK/example-data; it prints the `flwr run` to try
#   --work DIR      where everything goes (default ./fedsyn-local): pids, logs, ledgers
#   --strong N      the first N files (sorted by name) are strong nodes, the rest weak (1)
#   --epsilon E     every node's own total budget, node-config epsilon (8.0)
#   --port P        the SuperLink's port (Fleet, Control and Runtime API; default: free)
#   --tls DIR       serve TLS with DIR/{ca.crt,server.pem,server.key} (generate_certs.sh)
#   --auth          SuperNode authentication (needs --tls): a key pair per node
#                   (generate_node_keys.sh), registered with `flwr supernode register`
#   --name NAME     the SuperLink connection written to the CLI's config.toml (fedsyn-local)
#   --max-records N each node's public size bound (node-config max-records; default 300, a try-out's:
#                   the three example nodes serve within a minute on two cores): every release does
#                   the work of N records, and node-check embeds N rows once per snapshot before the
#                   node serves (it prints how long that took; 10x the bound, 10x the time: 1,000
#                   about 35 s a node side by side on two cores, an institution's 10,000 minutes)
#   --app DIR       the app every node approves in its FAB gate (default: this checkout)
#
# Each SuperNode runs behind its own FAB gate (WORK/nodes/NAME/gate/, a launcher per task process,
# first in its PATH) with its own allow-list (WORK/nodes/NAME/allow-list.txt) approving the FAB of --app: a
# try-out approves what you run; an institution reviews first (deploy/start_node.sh).
#
# Prints the PIDs it started and writes them to WORK/pids ("PID ROLE NAME" lines);
# deploy/stop_local_deployment.sh WORK stops exactly those (and their children).
# Flower's binaries are taken from FLWR_BIN (a folder) or PATH.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
[[ $# -ge 1 && "$1" != "-h" && "$1" != "--help" ]] || { usage; [[ $# -ge 1 ]] && exit 0 || exit 2; }

data_dir=$1; shift
example=0
[[ "$data_dir" == "--example" ]] && { example=1; data_dir=""; }
work=./fedsyn-local; max_records=300; strong=1; epsilon=8.0; port=""; tls=""; auth=0; name=fedsyn-local
app=$(cd "$(dirname "$0")/.." && pwd)
while [[ $# -gt 0 ]]; do
    case $1 in
        --work) work=$2; shift 2 ;;
        --max-records) max_records=$2; shift 2 ;;
        --strong) strong=$2; shift 2 ;;
        --epsilon) epsilon=$2; shift 2 ;;
        --port) port=$2; shift 2 ;;
        --tls) tls=$2; shift 2 ;;
        --auth) auth=1; shift ;;
        --name) name=$2; shift 2 ;;
        --app) app=$(cd "$2" && pwd); shift 2 ;;
        *) echo "error: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done
die() { echo "error: $*" >&2; exit 1; }

# --------------------------------------------------------------------------- binaries
if [[ -n "${FLWR_BIN:-}" ]]; then
    bin_dir=$FLWR_BIN
else
    command -v flower-superlink > /dev/null || die "flower-superlink is not on PATH; set FLWR_BIN to the venv's bin folder"
    bin_dir=$(dirname "$(command -v flower-superlink)")
fi
for b in flower-superlink flower-supernode flower-superexec flwr fedsyn; do
    [[ -x "$bin_dir/$b" ]] || die "$bin_dir/$b not found (set FLWR_BIN to the venv's bin folder)"
done
python=${PYTHON:-$bin_dir/python}
[[ -x "$python" ]] || python=$(command -v python3)
# SuperLink and SuperNodes start `flower-superexec`, `flwr-serverapp`, `flwr-clientapp` by name.
export PATH="$bin_dir:$PATH"
# Never `uv sync` an app at run time, no telemetry, no update check; offline Hugging Face.
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}
export TOKENIZERS_PARALLELISM=false
unset FLWR_INTERNAL_GRPC_CONTROL_API FLWR_INTERNAL_GRPC_FLEET_API  # HTTP APIs only

# --------------------------------------------------------------------------- inputs
if [[ $example == 1 ]]; then  # the shipped small data: 30 BBC articles a node, none shared
    mkdir -p "$work/example-data"
    data_dir=$work/example-data
    "$python" - "$data_dir" <<'PY' || die "cannot write the example data (is fedsyn installed in $python's venv?)"
import sys
from pathlib import Path

from common.tables import load_table

rows = load_table("bbc-news")[["text", "topic"]].sample(frac=1.0, random_state=0).reset_index(drop=True)
for i, name in enumerate(("hospital_a", "clinic_b", "practice_c")):
    rows.iloc[30 * i:30 * (i + 1)].to_csv(Path(sys.argv[1]) / f"{name}.csv", index=False)
PY
fi
[[ -d "$data_dir" ]] || die "data folder $data_dir does not exist"
data_dir=$(cd "$data_dir" && pwd)
mapfile -t files < <(find "$data_dir" -maxdepth 1 -type f \( -name '*.csv' -o -name '*.jsonl' -o -name '*.parquet' \) | sort)
[[ ${#files[@]} -ge 1 ]] || die "no .csv/.jsonl/.parquet files in $data_dir"
[[ "$strong" =~ ^[0-9]+$ ]] || die "--strong must be a number"
if [[ $auth == 1 && -z "$tls" ]]; then die "--auth needs --tls (Flower refuses SuperNode auth without TLS)"; fi
if [[ -n "$tls" ]]; then
    tls=$(cd "$tls" && pwd)
    for f in ca.crt server.pem server.key; do [[ -f "$tls/$f" ]] || die "$tls/$f missing (deploy/generate_certs.sh $tls)"; done
fi
mkdir -p "$work"
work=$(cd "$work" && pwd)
pidfile="$work/pids"
if [[ -s "$pidfile" ]]; then
    while read -r pid _; do
        [[ -d /proc/$pid ]] && die "$pidfile lists running PID $pid; run deploy/stop_local_deployment.sh $work first"
    done < "$pidfile"
fi
: > "$pidfile"

free_port() { "$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port_open() { "$python" -c 'import socket,sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1).close()' "$1" 2>/dev/null; }
started=()
fail() {  # stop what this script started, show the log, exit
    echo "error: $1" >&2
    [[ -f "${2:-}" ]] && { echo "--- last lines of $2:" >&2; tail -20 "$2" >&2; }
    "$(dirname "$0")/stop_local_deployment.sh" "$work" >&2 || true
    exit 1
}

# --------------------------------------------------------------------------- SuperLink
port=${port:-$(free_port)}
mkdir -p "$work/superlink/flwr-home"
if [[ -n "$tls" ]]; then
    link_tls=(--ssl-ca-certfile "$tls/ca.crt" --ssl-certfile "$tls/server.pem" --ssl-keyfile "$tls/server.key")
    [[ $auth == 1 ]] && link_tls+=(--enable-supernode-auth)
else
    link_tls=(--insecure)
fi
FLWR_HOME="$work/superlink/flwr-home" nohup "$bin_dir/flower-superlink" "${link_tls[@]}" \
    --host 127.0.0.1 --port "$port" --database "$work/superlink/state.db" \
    --disable-runtime-dependency-installation \
    > "$work/superlink/superlink.log" 2>&1 < /dev/null &
echo "$! superlink superlink" >> "$pidfile"
echo "SuperLink  PID $!  127.0.0.1:$port  log $work/superlink/superlink.log"
for _ in $(seq 1 120); do
    port_open "$port" && break
    [[ -d /proc/$! ]] || fail "the SuperLink exited" "$work/superlink/superlink.log"
    sleep 0.5
done
port_open "$port" || fail "the SuperLink did not open port $port within 60 s" "$work/superlink/superlink.log"

# --------------------------------------------------------------------------- CLI config
mkdir -p "$work/cli"
{
    echo "[superlink]"
    echo "default = \"$name\""
    echo
    echo "[superlink.$name]"
    echo "address = \"127.0.0.1:$port\""
    if [[ -n "$tls" ]]; then echo "root-certificates = \"$tls/ca.crt\""; else echo "insecure = true"; fi
} > "$work/cli/config.toml"
flwr_cli() { FLWR_HOME="$work/cli" "$bin_dir/flwr" "$@"; }

# --------------------------------------------------------------------------- SuperNodes
# Each node's gate, approval and node-check (loading the models, reading its file into its view and
# embedding it: most of the start-up) run side by side, then the SuperNodes start: three nodes' checks
# one after another took most of a minute (issue 75: a local deployment serves within 60 s).
node_name() { basename "${1%.*}"; }
node_tier() { [[ $1 -lt $strong ]] && echo strong || echo weak; }
node_config_of() {
    echo "tier=\"$2\" data-path=\"$1\" max-records=$max_records state-dir=\"$work/nodes/$(node_name "$1")/state\" epsilon=$epsilon"
}
prepare_node() {  # FILE TIER: the node's folders, key, FAB gate, approval and node-check; its exit code says
    local file=$1 tier=$2 node dir
    node=$(node_name "$file")
    dir="$work/nodes/$node"
    mkdir -p "$dir/flwr-home" "$dir/state"
    if [[ $auth == 1 ]]; then
        [[ -f "$dir/node_key" ]] || "$(dirname "$0")/generate_node_keys.sh" "$dir" node_key > /dev/null
    fi
    # The node's FAB gate: its launcher first in its PATH, its allow-list approving --app.
    "$bin_dir/fedsyn" node install-launcher "$dir/gate" --allow-list "$dir/allow-list.txt" > /dev/null \
        && "$bin_dir/fedsyn" node approve "$app" --allow-list "$dir/allow-list.txt" \
            --note "start_local_deployment.sh" > "$dir/approve.log" 2>&1 || { echo approve > "$dir/failed"; return 1; }
    # Flower runs no app code at SuperNode start: check the data and the gate now, not at the first request.
    # One user runs everything here (a try-out): --same-user says so; an institution uses start_node.sh --run-as.
    PATH="$dir/gate:$PATH" "$bin_dir/fedsyn" node-check --node-config "$(node_config_of "$file" "$tier")" \
        --same-user > "$dir/node-check.log" 2>&1 || { echo node-check > "$dir/failed"; return 1; }
}
preparing=()
i=0
for file in "${files[@]}"; do
    rm -f "$work/nodes/$(node_name "$file")/failed"
    prepare_node "$file" "$(node_tier $i)" &
    preparing+=($!)
    i=$((i + 1))
done
for pid in "${preparing[@]}"; do wait "$pid" || true; done
i=0
for file in "${files[@]}"; do
    node=$(node_name "$file")
    tier=$(node_tier $i)
    dir="$work/nodes/$node"
    if [[ -f "$dir/failed" ]]; then
        [[ $(cat "$dir/failed") == approve ]] && fail "cannot approve $app" "$dir/approve.log"
        fail "SuperNode $node cannot start: its data, node config or FAB gate is unusable" "$dir/node-check.log"
    fi
    built=$(grep -o "embedded the node's records as [0-9]* rows in [0-9.]* s" "$dir/node-check.log" | tail -1 || true)
    [[ -z "$built" ]] || echo "node-check $node: $built (max-records=$max_records: a bound 10x larger takes about 10x)"
    node_args=(--superlink "127.0.0.1:$port" --port "$(free_port)")
    if [[ -n "$tls" ]]; then node_args+=(--root-certificates "$tls/ca.crt"); else node_args+=(--insecure); fi
    if [[ $auth == 1 ]]; then
        flwr_cli supernode register "$dir/node_key.pub" "$name" --name "$node" > "$dir/register.log" 2>&1 \
            || fail "flwr supernode register failed for $node" "$dir/register.log"
        node_args+=(--auth-supernode-private-key "$dir/node_key")
    fi
    # the gate's flower-supernode: Flower's own, reading no app bundle that is not approved or over the bounds
    PATH="$dir/gate:$PATH" FLWR_HOME="$dir/flwr-home" nohup "$dir/gate/flower-supernode" "${node_args[@]}" \
        --node-config "$(node_config_of "$file" "$tier")" > "$dir/supernode.log" 2>&1 < /dev/null &
    echo "$! supernode $node" >> "$pidfile"
    echo "SuperNode  PID $!  $node ($tier, epsilon=$epsilon)  ledger $dir/state  log $dir/supernode.log"
    i=$((i + 1))
done

# Wait until every SuperNode is online at the SuperLink.
online=0
for _ in $(seq 1 60); do
    online=$(flwr_cli supernode list "$name" --format json 2>/dev/null \
        | "$python" -c 'import json,sys; print(sum(n["status"] == "online" for n in json.load(sys.stdin)["nodes"]))' \
        2>/dev/null || echo 0)
    [[ "$online" -ge ${#files[@]} ]] && break
    while read -r pid role node; do
        [[ -d /proc/$pid ]] || fail "$role $node (PID $pid) exited" "$work/${role/supernode/nodes\/$node}/$role.log"
    done < "$pidfile"
    sleep 1
done
[[ "$online" -ge ${#files[@]} ]] || fail "only $online of ${#files[@]} SuperNodes came online within 60 s"

echo
echo "PIDs: $(awk '{printf "%s ", $1}' "$pidfile")(in $pidfile)"
echo "Run fedsyn on it (the server's dataset is a public file, used for the vocabulary and held-out loss):"
echo "  FLWR_HOME=$work/cli FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 FLWR_TELEMETRY_ENABLED=0 \\"
if [[ $example == 1 ]]; then
    echo "    flwr run $app $name --stream --run-config 'min-nodes=${#files[@]}'"
    echo "  (the default run: its public BBC set gives the vocabulary; the nodes' articles are drawn from it, a try-out's shortcut)"
else
    echo "    flwr run /path/to/fedsyn $name --stream --run-config 'min-nodes=${#files[@]} dataset=\"/path/to/public.csv\" control-codes=\"...\"'"
fi
echo "Stop it: $(dirname "$0")/stop_local_deployment.sh $work"
