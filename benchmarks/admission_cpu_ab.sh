#!/usr/bin/env bash
# Admission at 3x capacity on the CPU engine (issue 31): `adaserve bench overload` against
# the shipped pair, this checkout's code and another's (BASE) alternated, two rounds each.
# Run it alone on the machine. Results: $OUT/{new,old}-{1,2}.json
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results/admission-ab}; mkdir -p "$OUT"
BASE=${BASE:?set BASE to the src folder of the code to compare (git worktree add /tmp/base REV; BASE=/tmp/base/src)}
run_one() {  # $1 label, $2 PYTHONPATH ("" for main), $3 round
  local port=$((8125 + $3))
  PYTHONPATH="$2" .venv/bin/adaserve serve --port $port > $OUT/$1-$3.server.log 2>&1 &
  local pid=$!
  for i in $(seq 1 150); do curl -s -m 2 http://127.0.0.1:$port/health >/dev/null && break; sleep 2; done
  PYTHONPATH="$2" timeout 400 .venv/bin/adaserve bench overload --base-url http://127.0.0.1:$port --duration 60 --factor 3 --json > $OUT/$1-$3.json 2> $OUT/$1-$3.err
  kill -INT $pid; wait $pid 2>/dev/null
}
for r in 1 2; do
  run_one new "" $r
  run_one old "$BASE" $r
done
echo finished > $OUT/done
