#!/usr/bin/env bash
# issue 31, thirteenth pass: the code before this pass (a worktree of OLD_REV at
# /tmp/oldtree with this pass's bench client copied in, put first on PYTHONPATH: the old
# server, the same client and summary) alternated with this pass's, a fresh server per
# run. RUN: the run script, ../admission-cpu-twelfth/retry.sh (retrying clients, the
# default) or ../admission-cpu-eleventh/run.sh (none); AB: the sets' prefix.
set -u
D=docs/results/raw/admission-cpu-thirteenth
cd "$(dirname "$0")/../../../.."
RUN=${RUN-docs/results/raw/admission-cpu-twelfth/retry.sh}
if [ ! -d /tmp/oldtree ]; then
  git worktree add /tmp/oldtree ${OLD_REV-60a8ae2}
  cp src/adaserve/bench/overload.py /tmp/oldtree/src/adaserve/bench/overload.py
fi
for n in ${RUNS-1 2 3 4 5}; do
  PYTHONPATH=/tmp/oldtree/src OUT=$D/${AB-ab}-old RUNS=$n bash $RUN
  OUT=$D/${AB-ab}-new RUNS=$n bash $RUN
done
