#!/usr/bin/env bash
# issue 30/31, tenth pass: the server confined off the engine's core (and the bench
# client with it) against the same code with both left free, runs alternated.
# NOCONFINE=1 through site/sitecustomize.py (replaces threads.confine_rest
# and threads.keep_off with no-ops) is how the "free" runs were made.
set -u
cd "$(dirname "$0")/../../../.."
D=docs/results/raw/admission-cpu-tenth
for n in ${RUNS-1 2 3 4 5}; do
  RUNS="$n" OUT=$D/confined bash $D/run.sh
  PYTHONPATH=$D/site NOCONFINE=1 RUNS="$n" OUT=$D/free bash $D/run.sh
done
