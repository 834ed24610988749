#!/usr/bin/env bash
# issue 31, seventh pass: the CPU engine over HTTP with the default check ("auto": the
# planner and, on this steep profile, the measured paces too), alone on the machine; a
# fresh server per run. RUNS: the seeds at 3x; ONE: the seeds at 1x, admission on and off
set -u
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-docs/results/raw/admission-cpu-seventh}
one() {  # $1 name, $2 seed, $3 factor, $4 server flags
  port=$((8150 + $2))
  .venv/bin/adaserve serve --port $port $4 > /tmp/cpu7-$1.server.log 2>&1 &
  pid=$!
  for i in $(seq 1 150); do curl -s -m 2 http://127.0.0.1:$port/health >/dev/null && break; sleep 2; done
  timeout 400 .venv/bin/adaserve bench overload --base-url http://127.0.0.1:$port --duration 60 --factor $3 --seed $2 --json > $OUT/$1.json 2> /tmp/cpu7-$1.err
  kill -INT $pid; wait $pid 2>/dev/null
  echo "$1 done $(date +%T)"
}
for n in ${RUNS-1 2 3 4 5}; do one auto-$n $n 3 ""; done
for n in ${ONE-}; do one on-1x-$n $n 1 ""; one off-1x-$n $n 1 "--no-admission"; done
