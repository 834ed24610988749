#!/usr/bin/env bash
# issue 31, thirteenth pass: no retrying clients (the strict goal's bench), the code
# before this pass (/tmp/oldtree, as ab.sh) alternated with this pass's, a fresh server
# per run (../admission-cpu-eleventh/run.sh). AB: the sets' prefix.
set -u
D=docs/results/raw/admission-cpu-thirteenth
cd "$(dirname "$0")/../../../.."
if [ ! -d /tmp/oldtree ]; then
  git worktree add /tmp/oldtree ${OLD_REV-60a8ae2}
  cp src/adaserve/bench/overload.py /tmp/oldtree/src/adaserve/bench/overload.py
fi
for n in ${RUNS-1 2 3 4 5}; do
  PYTHONPATH=/tmp/oldtree/src OUT=$D/${AB-nr}-old RUNS=$n bash docs/results/raw/admission-cpu-eleventh/run.sh
  OUT=$D/${AB-nr}-new RUNS=$n bash docs/results/raw/admission-cpu-eleventh/run.sh
done
