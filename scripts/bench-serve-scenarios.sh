#!/usr/bin/env bash
# The serving scenarios reported in the README (CPU, the `small` test checkpoint), each with
# `ember serve` and `ember bench serve` side by side in one run:
#   1. prefix cache: TTFT with a long shared system prompt, cache on vs off;
#   2. stragglers: latency with 10% of prompts 10x longer vs the same load without them;
#   3. overload: 1x and 3x the measured capacity under a shedding policy.
# Usage: scripts/bench-serve-scenarios.sh [OUT_DIR [prefix|stragglers|overload ...]]
#        (env: EMBER, MODEL, PORT; all three scenarios when none is named)
set -euo pipefail
OUT=${1:-bench-results}
shift || true
SCENARIOS=${*:-prefix stragglers overload}
EMBER=${EMBER:-.venv/bin/ember}
MODEL=${MODEL:-$HOME/.cache/ember/bench-small}
PORT=${PORT:-8311}
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"
[ -f "$MODEL/model.safetensors" ] || "$EMBER" make-test-model "$MODEL" --size small

start() {  # start the server with extra flags; sets PID
    "$EMBER" serve --model "$MODEL" --served-model-name small --host 127.0.0.1 --port "$PORT" \
        --log-level warning "$@" >"$OUT/server.log" 2>&1 &
    PID=$!
    until curl -sf "$URL/ready" >/dev/null; do
        kill -0 "$PID" 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
        sleep 0.5
    done
}
stop() { kill -TERM "$PID"; wait "$PID" || true; }
bench() { "$EMBER" bench serve --url "$URL" --model small --seed 0 "$@"; }

wants() { [[ " $SCENARIOS " == *" $1 "* ]]; }

# 1. Prefix cache: a ~1000-token shared prefix, a short question, a short answer. At 0.15 requests/s
#    neither server queues, so TTFT is the prefill itself; at 0.4 the uncached one falls behind.
if wants prefix; then
    for mode in enable no-enable; do
        start "--$mode-prefix-caching"
        for rate in 0.15 0.4; do
            bench --dataset shared-prefix --prefix-len 800 --input-len 8:16 --output-len 8:8 \
                --rate "$rate" --num-requests 12 --json "$OUT/prefix-$mode-$rate.json"
        done
        stop
    done
fi

# 2. Stragglers: the same arrival process with and without 10% of prompts 10x longer. A small step budget
#    bounds how much prefill shares a step with the running decodes.
if wants stragglers; then
    start --max-num-batched-tokens 64
    bench --dataset random --input-len 32:64 --output-len 32:32 --rate 1 --num-requests 40 \
        --json "$OUT/stragglers-without.json"
    bench --dataset random --input-len 32:64 --output-len 32:32 --rate 1 --num-requests 40 \
        --long-fraction 0.1 --long-factor 10 --json "$OUT/stragglers-with.json"
    stop
fi

# 3. Overload: at most 8 requests run at once (as KV memory bounds a GPU pod), so excess load queues.
#    Capacity is measured closed-loop at saturation, without shedding; then 1x and 3x of it, open-loop, on fresh servers
#    (so each one's queue-time histogram holds its own run), under a policy with one priority class.
if wants overload; then
    cat >"$OUT/policy.yaml" <<'YAML'
loadShedding:
  maxQueueDepth: 24
  maxQueueWaitSeconds: 3
  retryAfterSeconds: 1
  priorityClasses: [{name: standard, priority: 0}]
YAML
    start --max-num-seqs 8  # no shedding while measuring what the server can do
    bench --dataset random --input-len 32:64 --output-len 32:32 --rate inf --num-requests 48 \
        --max-concurrency 16 --json "$OUT/capacity.json"
    stop
    CAPACITY=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['results'][0]['request_throughput'])" \
        "$OUT/capacity.json")
    for load in 1 3; do
        rate=$(python3 -c "print(round($load * $CAPACITY, 3))")
        start --max-num-seqs 8 --policy "$OUT/policy.yaml"
        # The same span of arrivals (about 33 s) at either load.
        bench --dataset random --input-len 32:64 --output-len 32:32 --rate "$rate" --num-requests $((90 * load)) \
            --slo-ttft 5000 --slo-tpot 500 --timeout 120 --json "$OUT/overload-${load}x.json"
        curl -s "$URL/metrics" | grep -E '^(vllm:request_queue_time_seconds_(bucket|count)|ember:requests_shed_total|ember:queue_wait_over_limit_total)' \
            >"$OUT/overload-${load}x-metrics.txt"
        stop
    done
fi
echo "results in $OUT"
