#!/usr/bin/env bash
# Start a local cluster by hand: sites A, B, C and a witness on loopback, each a separate
# `diloco-node run` process using the example site configs, with loopback addresses, a private
# data directory per node and one shared secret given as flags (flags override the file).
#
#   examples/local-cluster.sh             # start, wait until every node is ready, then follow
#   examples/local-cluster.sh --dry-run   # only print the commands it would run
#
# Environment (deliberately not DILOCO_*, which diloco-node reads as configuration):
#   CLUSTER_DIR  where data, logs and the secret go (default: a new /tmp/diloco-cluster.XXXXXX)
#   BASE_PORT    first port; nodes use BASE_PORT..BASE_PORT+3 (default 7101)
#   NODE_CMD     how to invoke diloco-node (default: diloco-node, else python3 -m diloco_node)
#   READY_TIMEOUT_S  how long to wait for every /readyz (default 600: first JIT compile is slow)
# Ctrl-C stops every node with SIGTERM (each flushes its checkpoint and leaves the run).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; fi

base_port="${BASE_PORT:-7101}"
ready_timeout="${READY_TIMEOUT_S:-600}"
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

names=(site-a site-b site-c witness)
founder="127.0.0.1:${base_port}"

command_for() {  # name index -> the command line, one word per line
    local name="$1" index="$2" port=$((base_port + $2))
    printf '%s\n' "${node_cmd[@]}" run \
        --config "$here/sites/$name.toml" \
        --listen "127.0.0.1:$port" \
        --advertise "http://127.0.0.1:$port" \
        --data-dir "$cluster_dir/$name" \
        --secret-file "$cluster_dir/secret"
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

for i in "${!names[@]}"; do
    name="${names[$i]}"
    mapfile -t cmd < <(command_for "$name" "$i")
    echo "starting $name on 127.0.0.1:$((base_port + i)) (log: $cluster_dir/$name.log)"
    "${cmd[@]}" >"$cluster_dir/$name.log" 2>&1 &
    pids+=("$!")
    if (( i == 0 )); then sleep 2; fi  # let the founder bind before the others ask it to join
done

deadline=$((SECONDS + ready_timeout))
for i in "${!names[@]}"; do
    url="http://127.0.0.1:$((base_port + i))"
    until curl -fsS "$url/readyz" >/dev/null 2>&1; do
        if ! kill -0 "${pids[$i]}" 2>/dev/null; then
            echo "${names[$i]} exited; last log lines:" >&2
            tail -n 20 "$cluster_dir/${names[$i]}.log" >&2
            exit 1
        fi
        if (( SECONDS > deadline )); then
            echo "${names[$i]} not ready after ${ready_timeout}s; see $cluster_dir/${names[$i]}.log" >&2
            exit 1
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
