#!/usr/bin/env bash
# issue 31, eleventh pass: the overload bench alternating the code (company/) and the
# same code without the company bound (NOCOMPANY=1: nocompany/), a fresh server per run
set -u
cd "$(dirname "$0")/../../../.."
D=docs/results/raw/admission-cpu-eleventh
for n in ${RUNS-1 2 3 4 5}; do
  OUT=$D/ab/company RUNS=$n PYTHONPATH=$D/site bash $D/run.sh
  OUT=$D/ab/nocompany RUNS=$n NOCOMPANY=1 PYTHONPATH=$D/site bash $D/run.sh
done
