#!/usr/bin/env bash
# issue 31, eleventh pass: a flooding client beside served requests, refusals remembered
# (the code) and judged afresh (NOMEMO=1), servers alternated. OUT: where the JSON goes
set -u
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-docs/results/raw/admission-cpu-eleventh/flood}
mkdir -p "$OUT"
SITE=docs/results/raw/admission-cpu-eleventh/site
for round in ${ROUNDS-1 2 3}; do
  for v in ${VARIANTS-memo nomemo}; do
    port=8190
    if [ $v = nomemo ]; then export NOMEMO=1; else unset NOMEMO; fi
    PYTHONPATH=$SITE .venv/bin/adaserve serve --port $port > /tmp/flood-$v.log 2>&1 &
    pid=$!
    for i in $(seq 1 150); do curl -s -m 2 http://127.0.0.1:$port/health >/dev/null && break; sleep 2; done
    unset NOMEMO
    timeout 300 .venv/bin/python docs/results/raw/admission-cpu-eleventh/flood.py \
      http://127.0.0.1:$port ${WORKERS-16} ${VICTIMS-2} > "$OUT/$v-$round.json"
    curl -s http://127.0.0.1:$port/metrics | grep -E '^vllm:num_requests_shed|^adaserve_requests_shed|shed_total' | head -5 > "$OUT/$v-$round.metrics"
    kill -INT $pid; wait $pid 2>/dev/null
    echo "$v $round: $(cat "$OUT/$v-$round.json")"
  done
done
