#!/usr/bin/env bash
set -u
cd /work/main
OUT=${OUT:-/tmp/cpu-ab}; mkdir -p $OUT
run_one() {  # $1 check, $2 round
  local port=$((8140 + $2))
  .venv/bin/adaserve serve --port $port --admission-check $1 > $OUT/$1-$2.server.log 2>&1 &
  local pid=$!
  for i in $(seq 1 150); do curl -s -m 2 http://127.0.0.1:$port/health >/dev/null && break; sleep 2; done
  timeout 400 .venv/bin/adaserve bench overload --base-url http://127.0.0.1:$port --duration 60 --factor 3 --seed $2 --json > $OUT/$1-$2.json 2> $OUT/$1-$2.err
  kill -INT $pid; wait $pid 2>/dev/null
  echo "$1 $2 done $(date +%T)"
}
run_one planner 1; run_one paces 2; run_one planner 3; run_one paces 4; run_one planner 5
echo finished
