#!/bin/bash
# Clients that close on `data: [DONE]` (as load generators do) through `ember router`, A against B:
# counts the router's tracebacks, "broke off" warnings and upstream errors over 400 such streams across
# two engines on the packaged target. A is the router of git revision REV (default HEAD~1), B this tree's.
#   scripts/router_client_close.sh [REV]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REV=${1:-HEAD~1}
PY=$ROOT/.venv/bin/python
EMBER=$ROOT/.venv/bin/ember
M=$ROOT/engine/ember_engine/models/spec_pair/target
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
mkdir -p "$WORK/a"
git -C "$ROOT" archive "$REV" router/ember_router | tar -x -C "$WORK/a" --strip-components=1
for port in 8101 8102; do
  "$EMBER" serve --model "$M" --served-model-name target --port $port > "$WORK/engine-$port.log" 2>&1 &
done
for port in 8101 8102; do
  for _ in $(seq 240); do curl -sf localhost:$port/ready > /dev/null && break; sleep 0.5; done
done
cat > "$WORK/clients.py" <<'PY'
import asyncio, sys
import httpx
URL = sys.argv[1]
BODY = {"model": "target", "prompt": "def foo(", "max_tokens": 4, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
async def one(client):
    async with client.stream("POST", URL + "/v1/completions", json=BODY) as r:
        async for line in r.aiter_lines():
            if line.strip() == "data: [DONE]":
                break  # closes the connection before the response's end is read
async def main():
    async with httpx.AsyncClient(timeout=30) as client:
        for _ in range(100):
            await asyncio.gather(*(one(client) for _ in range(4)))
asyncio.run(main())
PY
for side in a b; do
  path=""; [ $side = a ] && path="$WORK/a"
  PYTHONPATH=$path "$EMBER" router --model "$M" --endpoint http://localhost:8101 --endpoint http://localhost:8102 \
    --port 8180 > "$WORK/router-$side.log" 2>&1 &
  router=$!
  for _ in $(seq 60); do curl -sf localhost:8180/ready > /dev/null && break; sleep 0.5; done
  "$PY" "$WORK/clients.py" http://localhost:8180
  errors=$(curl -s localhost:8180/metrics | awk '/^ember_router:upstream_errors_total/ {s += $2} END {print s + 0}')
  echo "$side ($([ $side = a ] && echo "$REV" || echo "this tree")): tracebacks $(grep -c Traceback "$WORK/router-$side.log" || true)," \
    "broke-off warnings $(grep -c 'broke off' "$WORK/router-$side.log" || true), upstream errors $errors"
  kill $router; wait $router 2>/dev/null || true
done
