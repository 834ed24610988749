#!/usr/bin/env bash
# issue 31, twelfth pass: the retry variants alternated, a fresh server per run (retry.sh)
# A: every held seat counts (PATIENCE=0), an idle engine admits; B: seats told longer
# than clients are seen to wait do not count; C: B, and an idle engine counts seats due
set -u
D=docs/results/raw/admission-cpu-twelfth
cd "$(dirname "$0")/../../../.."
export PYTHONPATH=$PWD/$D/site
for n in ${RUNS-3 4 5}; do
  PATIENCE=0 IDLE_SEATS=0 OUT=$D/var-A RUNS=$n bash $D/retry.sh
  PATIENCE=1 IDLE_SEATS=0 OUT=$D/var-B RUNS=$n bash $D/retry.sh
  PATIENCE=1 IDLE_SEATS=1 OUT=$D/var-C RUNS=$n bash $D/retry.sh
done
