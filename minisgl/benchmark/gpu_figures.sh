#!/usr/bin/env bash
# The GPU figures of docs/BENCHMARKS.md's current table for one user (W2) and for W1, each command as the
# table gives it, random bf16 weights (--load-format dummy), one part a call (each fits in ~5 minutes):
#   bash minisgl/benchmark/gpu_figures.sh w2 [GPT_FAST_DIR]   the one-kernel step's stages against their bytes
#        at the copy bandwidth (measured first; Qwen3-0.6B and Llama-3.2-1B shapes, 600 keys), W2 with both
#        shapes, and gpt-fast's W2 with Llama-3.2-1B shapes where a checkout of gpt-fast is given
#   bash minisgl/benchmark/gpu_figures.sh w1                  W1 with a bf16 KV pool, greedy and at T 0.6
# Each command's log goes to $OUT (default /tmp/gpu_figures); its result lines are printed.
set -uo pipefail
PART=${1:-}
case $PART in w1 | w2) ;; *)
    echo "usage: bash minisgl/benchmark/gpu_figures.sh w2 [GPT_FAST_DIR] | w1" >&2
    exit 2
    ;;
esac
GPT_FAST=${2:-}
OUT=${OUT:-/tmp/gpu_figures}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
B="python3 -m minisgl.benchmark.offline --dtype bfloat16 --load-format dummy"
TRACE="python3 -m minisgl.benchmark.profile_step --context 600 --step-trace --steps 10 --load-format dummy --dtype bfloat16"

run() {  # log-name result-pattern command...
    local log=$1 pattern=$2
    shift 2
    echo "== $*"
    "$@" 2>&1 | tee "$OUT/$log.log" | grep -E "$pattern"
}

nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader || {
    echo "gpu_figures.sh: no NVIDIA GPU here (nvidia-smi failed)" >&2
    exit 2
}
case $PART in
w2)
    for model in qwen3-0.6b llama-3.2-1b; do
        run "trace-$model" "^one-kernel|^\||^a layer" $TRACE --model $model
        run "w2-$model" "minisgl:|decode step of" $B --workload w2 --model $model --repeat 3 --cuda-graph-max-bs 1
    done
    if [ -n "$GPT_FAST" ]; then
        run w2-gpt-fast "gpt-fast:|Error" python3 -m minisgl.benchmark.gptfast_peer --gpt-fast-dir "$GPT_FAST" \
            --model llama-3.2-1b
    fi
    ;;
w1)
    run w1-greedy "minisgl:" $B --workload w1 --model qwen3-0.6b --repeat 3
    run w1-t06 "minisgl:" $B --workload w1 --model qwen3-0.6b --repeat 3 --temperature 0.6
    ;;
esac
