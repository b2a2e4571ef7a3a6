#!/usr/bin/env bash
# Try fedsyn's simulation on a Ray cluster on one machine: a head and one or more worker Ray
# nodes on loopback (127.0.0.1), each with its own resources and its own temp directory, as
# if on its own host. Every Ray node gets the same FEDSYN_STATE_DIR, so a simulated node keeps
# one ledger wherever Flower runs its next message (fedsyn_client/node.py).
#
# Usage: deploy/start_ray_cluster.sh [options]
#
#   --work DIR         where everything goes (default ./fedsyn-ray): pids, logs, env, state
#   --workers N        worker Ray nodes besides the head (1)
#   --head-cpus C      CPUs the head offers to ClientApp actors (1)
#   --worker-cpus C    CPUs each worker offers (1)
#   --head-gpus G      GPUs the head offers (0)
#   --worker-gpus G    GPUs each worker offers (0)
#   --port P           the head's GCS port (default: free)
#   --state-dir DIR    the shared node state of every Ray node (default WORK/state)
#
# Writes WORK/pids ("PID ROLE NAME" lines) and WORK/env (RAY_ADDRESS, FEDSYN_STATE_DIR). Then:
#   . WORK/env && fedsyn run . --federation-config 'num-supernodes=10 client-resources-num-cpus=1'
# (RAY_ADDRESS must reach the local SuperLink that `fedsyn run` starts: stop an older one first.)
# deploy/stop_ray_cluster.sh WORK stops exactly what this started. Ray comes from RAY_BIN (a
# folder) or PATH; the ClientApps run with that folder's Python.
set -euo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }
[[ "${1:-}" == "-h" || "${1:-}" == "--help" ]] && { usage; exit 0; }

work=./fedsyn-ray; workers=1; head_cpus=1; worker_cpus=1; head_gpus=0; worker_gpus=0; port=""; state=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --work) work=$2; shift 2 ;;
        --workers) workers=$2; shift 2 ;;
        --head-cpus) head_cpus=$2; shift 2 ;;
        --worker-cpus) worker_cpus=$2; shift 2 ;;
        --head-gpus) head_gpus=$2; shift 2 ;;
        --worker-gpus) worker_gpus=$2; shift 2 ;;
        --port) port=$2; shift 2 ;;
        --state-dir) state=$2; shift 2 ;;
        *) echo "error: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done
die() { echo "error: $*" >&2; exit 1; }
for v in "$workers" "$head_cpus" "$worker_cpus" "$head_gpus" "$worker_gpus"; do
    [[ "$v" =~ ^[0-9]+$ ]] || die "--workers, --*-cpus and --*-gpus take whole numbers (got $v)"
done

if [[ -n "${RAY_BIN:-}" ]]; then bin_dir=$RAY_BIN; else
    command -v ray > /dev/null || die "ray is not on PATH; set RAY_BIN to the venv's bin folder"
    bin_dir=$(dirname "$(command -v ray)")
fi
[[ -x "$bin_dir/ray" ]] || die "$bin_dir/ray not found (set RAY_BIN to the venv's bin folder)"
python=$bin_dir/python
[[ -x "$python" ]] || python=$(command -v python3)
export RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TRANSFORMERS_OFFLINE=${TRANSFORMERS_OFFLINE:-1}
export TOKENIZERS_PARALLELISM=false

mkdir -p "$work"
work=$(cd "$work" && pwd)
state=${state:-$work/state}
mkdir -p "$state"
state=$(cd "$state" && pwd)
pidfile="$work/pids"
if [[ -s "$pidfile" ]]; then
    while read -r pid _; do
        [[ -d /proc/$pid ]] && die "$pidfile lists running PID $pid; run deploy/stop_ray_cluster.sh $work first"
    done < "$pidfile"
fi
: > "$pidfile"
port=${port:-$("$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
# Ray's session folder holds Unix sockets (at most 107 bytes of path): keep it short and shared
# by the Ray nodes of this cluster only.
ray_tmp=$(mktemp -d "${TMPDIR:-/tmp}/fr-XXXXXX")
echo "$ray_tmp" > "$work/ray-tmp"
fail() {
    echo "error: $1" >&2
    [[ -f "${2:-}" ]] && { echo "--- last lines of $2:" >&2; tail -20 "$2" >&2; }
    "$(dirname "$0")/stop_ray_cluster.sh" "$work" >&2 || true
    exit 1
}

start_node() {  # NAME CPUS GPUS RAY-ARGS...: one `ray start --block` in its own session
    local name=$1 cpus=$2 gpus=$3; shift 3
    local dir="$work/nodes/$name"
    mkdir -p "$dir/tmp"
    # TMPDIR is the Ray node's own (another machine's disk); FEDSYN_STATE_DIR is shared.
    TMPDIR="$dir/tmp" RAY_TMPDIR="$ray_tmp" FEDSYN_STATE_DIR="$state" setsid nohup "$bin_dir/ray" start --block \
        --node-ip-address 127.0.0.1 --num-cpus "$cpus" --num-gpus "$gpus" --disable-usage-stats "$@" \
        > "$dir/ray.log" 2>&1 < /dev/null &
    echo "$! $name $name" >> "$pidfile"
    echo "Ray node $name  PID $!  cpus=$cpus gpus=$gpus  log $dir/ray.log"
}

alive_nodes() {
    RAY_ADDRESS="127.0.0.1:$port" "$python" -c \
        'import ray; ray.init(logging_level="ERROR"); print(sum(n["Alive"] for n in ray.nodes()))' 2>/dev/null || echo 0
}

start_node head "$head_cpus" "$head_gpus" --head --port "$port" --include-dashboard false --temp-dir "$ray_tmp"
for _ in $(seq 1 120); do
    grep -q "Ray runtime started" "$work/nodes/head/ray.log" 2>/dev/null && break
    [[ -d /proc/$(awk 'NR == 1 { print $1 }' "$pidfile") ]] || fail "the head exited" "$work/nodes/head/ray.log"
    sleep 0.5
done
grep -q "Ray runtime started" "$work/nodes/head/ray.log" || fail "the head did not start within 60 s" "$work/nodes/head/ray.log"
for i in $(seq 1 "$workers"); do
    start_node "worker-$i" "$worker_cpus" "$worker_gpus" --address "127.0.0.1:$port"
done

want=$((workers + 1)); have=0
for _ in $(seq 1 60); do
    have=$(alive_nodes)
    [[ "$have" -ge "$want" ]] && break
    while read -r pid role _; do
        [[ -d /proc/$pid ]] || fail "Ray node $role (PID $pid) exited" "$work/nodes/$role/ray.log"
    done < "$pidfile"
    sleep 1
done
[[ "$have" -ge "$want" ]] || fail "only $have of $want Ray nodes joined within 60 s"

printf 'export RAY_ADDRESS=127.0.0.1:%s\nexport FEDSYN_STATE_DIR=%q\n' "$port" "$state" > "$work/env"
echo
echo "Ray cluster of $want nodes at 127.0.0.1:$port; simulated nodes' state in $state"
echo "Run fedsyn on it:"
echo "  . $work/env && fedsyn run . --federation-config 'num-supernodes=4 client-resources-num-cpus=1'"
echo "Stop it: $(dirname "$0")/stop_ray_cluster.sh $work"
