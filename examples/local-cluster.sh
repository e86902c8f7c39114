#!/usr/bin/env bash
# Start a local cluster by hand: sites A, B, C and a witness on loopback, each a separate
# `diloco-node run` process using the example site configs, with loopback addresses, a private
# data directory per node and one shared secret given as flags (flags override the file).
# The configs put the operator routes on 127.0.0.1:7071 (safe on a real host); here every port is
# loopback already, so `--set status_listen=` (empty: unset) keeps them on each node's own port.
# The founder (site A) starts first; the others start once its /livez answers, and a joiner that
# exits before it is ready (say the founder was slow) is started again, with a growing pause.
#
#   examples/local-cluster.sh             # start, wait until every node is ready, then follow
#   examples/local-cluster.sh --dry-run   # only print the commands it would run
#
# Environment (deliberately not DILOCO_*, which diloco-node reads as configuration):
#   CLUSTER_DIR  where data, logs and the secret go (default: a new /tmp/diloco-cluster.XXXXXX)
#   BASE_PORT    first port; nodes use BASE_PORT..BASE_PORT+3 (default 7101)
#   NODES        how many of site-a, site-b, site-c, witness to start, in that order (default 4)
#   NODE_CMD     how to invoke diloco-node (default: diloco-node, else python3 -m diloco_node)
#   READY_TIMEOUT_S  how long to wait for every /readyz (default 600: first JIT compile is slow)
#   JOIN_ATTEMPTS    how many times a joiner is started before the script gives up (default 5)
# Ctrl-C stops every node with SIGTERM (each flushes its checkpoint and leaves the run).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; fi

base_port="${BASE_PORT:-7101}"
ready_timeout="${READY_TIMEOUT_S:-600}"
join_attempts="${JOIN_ATTEMPTS:-5}"
if [[ -n "${NODE_CMD:-}" ]]; then
    read -r -a node_cmd <<<"$NODE_CMD"
elif command -v diloco-node >/dev/null 2>&1; then
    node_cmd=(diloco-node)
else
    node_cmd=(python3 -m diloco_node)
fi
if [[ -n "${CLUSTER_DIR:-}" ]]; then
    cluster_dir="$CLUSTER_DIR"
elif (( dry_run )); then
    cluster_dir="/tmp/diloco-cluster.DRYRUN"
else
    cluster_dir="$(mktemp -d /tmp/diloco-cluster.XXXXXX)"
fi

all_names=(site-a site-b site-c witness)
node_count="${NODES:-4}"
if ! [[ "$node_count" =~ ^[1-4]$ ]]; then
    echo "NODES=$node_count: must be 1 to 4" >&2
    exit 2
fi
names=("${all_names[@]:0:$node_count}")
founder="127.0.0.1:${base_port}"

command_for() {  # name index -> the command line, one word per line
    local name="$1" index="$2" port=$((base_port + $2))
    printf '%s\n' "${node_cmd[@]}" run \
        --config "$here/sites/$name.toml" \
        --listen "127.0.0.1:$port" \
        --advertise "http://127.0.0.1:$port" \
        --data-dir "$cluster_dir/$name" \
        --secret-file "$cluster_dir/secret" \
        --set status_listen=
    if (( index > 0 )); then printf '%s\n' --bootstrap "$founder"; fi
}

if (( dry_run )); then
    for i in "${!names[@]}"; do
        mapfile -t cmd < <(command_for "${names[$i]}" "$i")
        printf '%q ' "${cmd[@]}"; echo
    done
    exit 0
fi

mkdir -p "$cluster_dir"
if [[ ! -s "$cluster_dir/secret" ]]; then
    (umask 077 && head -c 32 /dev/urandom | base64 >"$cluster_dir/secret")
fi

pids=()
stop_all() {
    trap - EXIT INT TERM
    if (( ${#pids[@]} )); then
        echo "stopping ${#pids[@]} nodes (SIGTERM)..."
        kill -TERM "${pids[@]}" 2>/dev/null || true
        wait "${pids[@]}" 2>/dev/null || true
    fi
    echo "data and logs kept in $cluster_dir"
}
trap stop_all EXIT INT TERM

start_node() {  # index: start that node in the background, its output appended to its log
    local name="${names[$1]}" cmd
    mapfile -t cmd < <(command_for "$name" "$1")
    echo "starting $name on 127.0.0.1:$((base_port + $1)) (log: $cluster_dir/$name.log)"
    "${cmd[@]}" >>"$cluster_dir/$name.log" 2>&1 &
    pids[$1]=$!
}

fail() {  # index message: say why, show the node's last log lines, stop the cluster
    echo "$2" >&2
    tail -n 20 "$cluster_dir/${names[$1]}.log" >&2
    exit 1
}

deadline=$((SECONDS + ready_timeout))
start_node 0
# Joiners ask the founder to admit them: start them once the founder's HTTP server answers.
until curl -fs "http://$founder/livez" >/dev/null 2>&1; do
    if ! kill -0 "${pids[0]}" 2>/dev/null; then fail 0 "${names[0]} exited before it answered /livez; last log lines:"; fi
    if (( SECONDS > deadline )); then fail 0 "${names[0]} not live after ${ready_timeout}s; last log lines:"; fi
    sleep 0.5
done
echo "${names[0]} live at http://$founder"
for ((i = 1; i < ${#names[@]}; i++)); do start_node "$i"; done

for i in "${!names[@]}"; do
    url="http://127.0.0.1:$((base_port + i))"
    attempt=1
    until curl -fs "$url/readyz" >/dev/null 2>&1; do
        if ! kill -0 "${pids[$i]}" 2>/dev/null; then
            code=0; wait "${pids[$i]}" || code=$?
            # 0 (the run is complete) and 2 (a configuration error) would end the same way again.
            if (( i == 0 || code == 0 || code == 2 || attempt >= join_attempts )); then
                fail "$i" "${names[$i]} exited with code $code; last log lines:"
            fi
            echo "${names[$i]} exited with code $code before it was ready; joining again in $((2 * attempt))s (attempt $((attempt + 1)) of $join_attempts)" >&2
            sleep $((2 * attempt))
            attempt=$((attempt + 1))
            start_node "$i"
        fi
        if (( SECONDS > deadline )); then
            fail "$i" "${names[$i]} not ready after ${ready_timeout}s; last log lines:"
        fi
        sleep 1
    done
    echo "${names[$i]} ready at $url"
done

peers=()
for i in "${!names[@]}"; do peers+=(--peer "http://127.0.0.1:$((base_port + i))"); done
echo
echo "all nodes ready. Watch them with:"
echo "  ${node_cmd[*]} watch ${peers[*]}"
echo "Ctrl-C here stops the cluster."
wait "${pids[@]}"
