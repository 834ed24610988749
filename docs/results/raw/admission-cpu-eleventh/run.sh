#!/usr/bin/env bash
# issue 31, eleventh pass: the CPU engine over HTTP, alone on the machine, a fresh server per
# run. RUNS: the seeds; FACTOR: offered load over the probed capacity (default 3);
# RATE: a fixed offered req/s instead; OUT: where the JSON goes; FLAGS: server flags
set -u
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-docs/results/raw/admission-cpu-eleventh}
mkdir -p "$OUT"
for n in ${RUNS-1 2 3 4 5}; do
  port=$((8150 + n))
  .venv/bin/adaserve serve --port $port ${FLAGS-} > /tmp/cpu11-$n.server.log 2>&1 &
  pid=$!
  for i in $(seq 1 150); do curl -s -m 2 http://127.0.0.1:$port/health >/dev/null && break; sleep 2; done
  timeout 400 ${CLIENT_PREFIX-} .venv/bin/adaserve bench overload --base-url http://127.0.0.1:$port --duration 60 \
    --factor ${FACTOR-3} ${RATE:+--rate $RATE} --seed $n --json > "$OUT/run-$n.json" 2> /tmp/cpu11-$n.err
  curl -s http://127.0.0.1:$port/v1/slo/report > "$OUT/run-$n.report.json"
  kill -INT $pid; wait $pid 2>/dev/null
  echo "run $n done $(date +%T)"
done
