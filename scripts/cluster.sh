#!/usr/bin/env bash
# N replicas of `compiled-engine serve` behind one of the field's routers, all on 127.0.0.1, no
# docker, no Kubernetes (for that: deploy/). Ctrl-C stops all of them.
#
#   scripts/cluster.sh                     # 2 demo replicas on 18801-18802, sglang-router on 8000
#   N=4 MODEL=/path/to/checkpoint scripts/cluster.sh
#   ROUTER=vllm scripts/cluster.sh         # vllm-router instead (the same flags)
#   ROUTER=vllm POLICY=kv_aware scripts/cluster.sh   # replicas publish KV events on 5557, 5558, ...
#
# Environment: N (2), BASE_PORT (18801), MODEL (demo), ROUTER (sglang | vllm), POLICY (cache_aware;
# any the router has), ROUTER_PORT (8000), KV_BASE_PORT (5557: kv_aware's KV event ports),
# SERVE_ARGS (more flags for every replica), WAIT_S (600: how long a replica may take to answer
# /health with 200), LOG_DIR (a temporary folder).
set -euo pipefail

N=${N:-2}
BASE_PORT=${BASE_PORT:-18801}
MODEL=${MODEL:-demo}
ROUTER=${ROUTER:-sglang}
ROUTER_PORT=${ROUTER_PORT:-8000}
POLICY=${POLICY:-cache_aware}
KV_BASE_PORT=${KV_BASE_PORT:-5557}
read -r -a serve_args <<<"${SERVE_ARGS:-}"
WAIT_S=${WAIT_S:-600}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
LOG_DIR=${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/compiled-engine-cluster.XXXXXX")}
mkdir -p "$LOG_DIR"

case "$ROUTER" in
    sglang) router_cmd=("$VENV/bin/python" -m sglang_router.launch_router) ;;
    vllm) router_cmd=("$VENV/bin/vllm-router") ;;
    *) echo "ROUTER must be sglang or vllm, not '$ROUTER'" >&2; exit 2 ;;
esac

pids=()
cleanup() {
    trap - EXIT INT TERM
    local pid
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

free_port() {
    "$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# answers GET $1 with 200?
healthy() {
    "$VENV/bin/python" - "$1" <<'EOF'
import sys
import urllib.request

try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as reply:
        sys.exit(0 if reply.status == 200 else 1)
except OSError:
    sys.exit(1)
EOF
}

urls=()
for ((i = 0; i < N; i++)); do
    port=$((BASE_PORT + i))
    kv=()
    if [ "$POLICY" = kv_aware ]; then
        kv=(--kv-events-config "{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://127.0.0.1:$((KV_BASE_PORT + i))\"}")
    fi
    "$VENV/bin/compiled-engine" serve --model "$MODEL" --host 127.0.0.1 --port "$port" \
        "${kv[@]}" "${serve_args[@]}" >"$LOG_DIR/replica-$port.log" 2>&1 &
    pids+=("$!")
    urls+=("http://127.0.0.1:$port")
    echo "replica $i: http://127.0.0.1:$port (log: $LOG_DIR/replica-$port.log)"
done

deadline=$((SECONDS + WAIT_S))
for ((i = 0; i < N; i++)); do
    until healthy "${urls[$i]}/health"; do
        if ! kill -0 "${pids[$i]}" 2>/dev/null; then
            echo "replica ${urls[$i]} exited; its log:" >&2
            tail -n 30 "$LOG_DIR/replica-$((BASE_PORT + i)).log" >&2
            exit 1
        fi
        if ((SECONDS >= deadline)); then
            echo "replica ${urls[$i]} not healthy after ${WAIT_S} s (log: $LOG_DIR)" >&2
            exit 1
        fi
        sleep 2
    done
    echo "replica ${urls[$i]} is healthy"
done

"${router_cmd[@]}" --worker-urls "${urls[@]}" --policy "$POLICY" \
    --host 127.0.0.1 --port "$ROUTER_PORT" \
    --prometheus-host 127.0.0.1 --prometheus-port "$(free_port)" \
    >"$LOG_DIR/router.log" 2>&1 &
pids+=("$!")
router_pid=$!

deadline=$((SECONDS + 60))
until healthy "http://127.0.0.1:$ROUTER_PORT/health"; do
    if ! kill -0 "$router_pid" 2>/dev/null || ((SECONDS >= deadline)); then
        echo "the router did not start; its log:" >&2
        tail -n 30 "$LOG_DIR/router.log" >&2
        exit 1
    fi
    sleep 1
done

echo "$ROUTER router: http://127.0.0.1:$ROUTER_PORT (OpenAI API under /v1; log: $LOG_DIR/router.log)"
echo "Ctrl-C stops the router and the replicas"
wait "$router_pid"
