#!/usr/bin/env bash
# The serving scenarios reported in the README (CPU, the `small` test checkpoint), each with
# `ember serve` and `ember bench serve` side by side in one run:
#   1. prefix cache: TTFT with a long shared system prompt, cache on vs off;
#   2. stragglers: latency with 10% of prompts 10x longer vs the same load without them;
#   3. overload: 1x and 3x the measured capacity under a shedding policy.
# Usage: scripts/bench-serve-scenarios.sh [OUT_DIR]   (env: EMBER, MODEL, PORT)
set -euo pipefail
OUT=${1:-bench-results}
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

# 1. Prefix cache: a ~1000-token shared prefix, a short question, a short answer, at a low rate so that
#    nothing queues and TTFT is the prefill itself.
for mode in enable no-enable; do
    start "--$mode-prefix-caching"
    bench --dataset shared-prefix --prefix-len 800 --input-len 8:16 --output-len 8:8 \
        --rate 0.4 --num-requests 16 --json "$OUT/prefix-$mode.json"
    stop
done

# 2. Stragglers: the same arrival process with and without 10% of prompts 10x longer. A small step budget
#    bounds how much prefill shares a step with the running decodes.
start --max-num-batched-tokens 64
bench --dataset random --input-len 32:64 --output-len 32:32 --rate 1 --num-requests 40 \
    --json "$OUT/stragglers-without.json"
bench --dataset random --input-len 32:64 --output-len 32:32 --rate 1 --num-requests 40 \
    --long-fraction 0.1 --long-factor 10 --json "$OUT/stragglers-with.json"
stop

# 3. Overload: capacity measured at saturation, then 1x and 3x of it under a shedding policy.
cat >"$OUT/policy.yaml" <<'YAML'
loadShedding: {maxQueueDepth: 16, maxQueueWaitSeconds: 4, retryAfterSeconds: 1}
YAML
start --policy "$OUT/policy.yaml"
bench --dataset random --input-len 32:64 --output-len 32:32 --rate inf --num-requests 16 \
    --json "$OUT/capacity.json"
CAPACITY=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['results'][0]['request_throughput'])" \
    "$OUT/capacity.json")
ONE=$(python3 -c "print(round($CAPACITY, 3))")
THREE=$(python3 -c "print(round(3 * $CAPACITY, 3))")
bench --dataset random --input-len 32:64 --output-len 32:32 --rate "$ONE" --num-requests 60 \
    --slo-ttft 6000 --slo-tpot 500 --timeout 120 --json "$OUT/overload-1x.json"
stop
# A fresh server, so its queue-time histogram holds the 3x run alone.
start --policy "$OUT/policy.yaml"
bench --dataset random --input-len 32:64 --output-len 32:32 --rate "$THREE" --num-requests 60 \
    --slo-ttft 6000 --slo-tpot 500 --timeout 120 --json "$OUT/overload-3x.json"
curl -s "$URL/metrics" | grep -E '^(vllm:request_queue_time_seconds_(bucket|count|sum)|ember:requests_shed_total)' \
    >"$OUT/overload-3x-metrics.txt"
stop
echo "results in $OUT"
