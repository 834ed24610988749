#!/usr/bin/env bash
# issue 31, eleventh pass: the overload bench's probed capacity with admission on and off,
# servers alternated (a 1 s run after each probe; only capacity_rps is read)
set -u
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-docs/results/raw/admission-cpu-eleventh/capacity}
mkdir -p "$OUT"
for n in ${RUNS-1 2 3}; do
  for v in on off; do
    port=8160
    flags=""; [ $v = off ] && flags="--no-admission"
    .venv/bin/adaserve serve --port $port $flags > /tmp/cap-$v.log 2>&1 &
    pid=$!
    for i in $(seq 1 150); do curl -s -m 2 http://127.0.0.1:$port/health >/dev/null && break; sleep 2; done
    timeout 120 .venv/bin/adaserve bench overload --base-url http://127.0.0.1:$port --duration 1 \
      --seed $n --json > "$OUT/$v-$n.json" 2>/dev/null
    kill -INT $pid; wait $pid 2>/dev/null
    echo "$v $n: $(python3 -c "import json; d = json.load(open('$OUT/$v-$n.json')); print(round(d['capacity_rps'], 2), round(d['capacity_within_slo_rps'], 2))")"
  done
done
