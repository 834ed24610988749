#!/usr/bin/env bash
# issue 31, fourteenth pass: the strict goal's bench (3x, no retrying clients) with every
# pass, admission and finish logged (site/sitecustomize.py, MISS_LOG). RUNS: seeds;
# OUT: where the JSON and logs go.
set -u
D=docs/results/raw/admission-cpu-fourteenth
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-$D/miss}
mkdir -p "$OUT"
for n in ${RUNS-1 2 3}; do
  rm -f "$OUT/miss-$n.jsonl"
  MISS_LOG=$PWD/$OUT/miss-$n.jsonl PYTHONPATH=$PWD/$D/site${PYTHONPATH:+:$PYTHONPATH} \
    OUT=$OUT RUNS=$n bash docs/results/raw/admission-cpu-eleventh/run.sh
done
