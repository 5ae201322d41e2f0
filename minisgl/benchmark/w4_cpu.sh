#!/usr/bin/env bash
# W4 on the CPU: the minisgl service, then `transformers serve --continuous-batching`, on the default model,
# each measured by the same client (minisgl.benchmark.online, 48 requests, 16 at a time, max_tokens 128).
#   bash minisgl/benchmark/w4_cpu.sh [minisgl dtype (float32)] [peer dtype (bfloat16)] [extra client args]
# Servers run one after the other so they never share the cores; logs go to $OUT (default /tmp/w4).
set -euo pipefail
OURS=${1:-float32}
PEER=${2:-bfloat16}
shift $(( $# < 2 ? $# : 2 ))
OUT=${OUT:-/tmp/w4}
mkdir -p "$OUT"
MODEL_DIR=$(python -c "from minisgl.models.resolve import resolve_model_path; print(resolve_model_path(None))" | tail -1)

wait_ready() {  # url pid
    for _ in $(seq 600); do
        curl -sf "$1/models" >/dev/null && return 0
        kill -0 "$2" 2>/dev/null || { echo "server exited; see $OUT" >&2; return 1; }
        sleep 1
    done
    return 1
}

python -m minisgl --port 1919 --dtype "$OURS" >"$OUT/minisgl.log" 2>&1 &
PID=$!
wait_ready http://127.0.0.1:1919/v1 $PID
echo "== minisgl ($OURS)"
python -m minisgl.benchmark.online --base-url http://127.0.0.1:1919/v1 "$@" | tee "$OUT/minisgl.txt"
kill $PID; wait $PID || true

transformers serve "$MODEL_DIR" --continuous-batching --dtype "$PEER" --device cpu --port 1920 >"$OUT/peer.log" 2>&1 &
PID=$!
wait_ready http://127.0.0.1:1920/v1 $PID
echo "== transformers serve --continuous-batching ($PEER)"
python -m minisgl.benchmark.online --base-url http://127.0.0.1:1920/v1 --model "$MODEL_DIR" "$@" | tee "$OUT/peer.txt"
kill $PID; wait $PID || true
