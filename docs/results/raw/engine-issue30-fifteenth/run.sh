#!/usr/bin/env bash
# Issue 30, fifteenth session: the engine at three loads (best baseline about 95 / 80 /
# 60%), three rounds each, then the simulator on the same profile, workloads and seeds.
# Run alone on the machine:  OUT=DIR bash docs/results/raw/engine-issue30-fifteenth/run.sh
# (a/: the code before the planner learned the time between passes, at d1cc80c; b/: after)
set -eu
cd "$(dirname "$0")/../../../.."
D=${OUT:-docs/results/raw/engine-issue30-fifteenth/b}; mkdir -p "$D"
A=.venv/bin/adaserve
POL=adaserve,dyn-tree,spec-chain:4,ar
PROFILE=$(ls ~/.cache/adaserve/profiles/*-cpu-float32-*-1t-f7.json | head -1)
run() {  # name rate seed mix
  local mix=()
  [ -n "$4" ] && mix=(--class-mix "$4")
  $A bench serve --request-rate "$2" --duration 20 --seed "$3" --repeat 3 "${mix[@]}" \
    --policies $POL --no-plots --no-progress --out "$D/e-$1" > "$D/e-$1.txt" 2>&1
}
sim() {
  local mix=()
  [ -n "$4" ] && mix=(--class-mix "$4")
  $A simulate --profile "$PROFILE" --stats src/adaserve/assets/pair_stats.json \
    --selection-time measured --request-rate "$2" --duration 20 --seed "$3" "${mix[@]}" \
    --policies $POL --out "$D/s-$1" > "$D/s-$1.txt" 2>&1
}
set -- l25 2.5 2 "" l35 3.5 0 "" l4 4 1 interactive:0.3,chat:0.2,batch:0.5
while [ $# -ge 4 ]; do
  date; echo "engine $1"; run "$1" "$2" "$3" "$4"
  shift 4
done
set -- l25 2.5 2 "" l35 3.5 0 "" l4 4 1 interactive:0.3,chat:0.2,batch:0.5
while [ $# -ge 4 ]; do
  date; echo "sim $1"; sim "$1" "$2" "$3" "$4"
  shift 4
done
date
