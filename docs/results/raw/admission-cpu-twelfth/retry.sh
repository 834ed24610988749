#!/usr/bin/env bash
# issue 31, twelfth pass: retrying clients on the CPU engine over HTTP, alone on the
# machine, a fresh server per run. RUNS: the seeds; OUT: where the JSON goes; ADM_LOG
# (with PYTHONPATH=.../site): one line per admission verdict. Each client refused with a
# Retry-After of at most 30 s comes back once, with its Retry-Token.
set -u
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-docs/results/raw/admission-cpu-twelfth/retry}
mkdir -p "$OUT"
for n in ${RUNS-1 2 3}; do
  port=$((8170 + n))
  .venv/bin/adaserve serve --port $port ${FLAGS-} > /tmp/cpu12-$n.server.log 2>&1 &
  pid=$!
  for i in $(seq 1 150); do curl -s -m 2 http://127.0.0.1:$port/health >/dev/null && break; sleep 2; done
  timeout 500 .venv/bin/adaserve bench overload --base-url http://127.0.0.1:$port --duration 60 \
    --factor ${FACTOR-3} --retry 30 --seed $n --json > "$OUT/run-$n.json" 2> /tmp/cpu12-$n.err
  curl -s http://127.0.0.1:$port/v1/slo/report > "$OUT/run-$n.report.json"
  kill -INT $pid; wait $pid 2>/dev/null
  echo "run $n done $(date +%T)"
done
