#!/usr/bin/env bash
# issue 31, thirteenth pass: retrying clients, the code before this pass (a worktree of
# OLD_REV at /tmp/oldtree with this pass's bench client copied in, put first on
# PYTHONPATH: the old server, the same client and summary) alternated with this pass's,
# a fresh server per run (../admission-cpu-twelfth/retry.sh). AB: the sets' prefix.
set -u
D=docs/results/raw/admission-cpu-thirteenth
cd "$(dirname "$0")/../../../.."
if [ ! -d /tmp/oldtree ]; then
  git worktree add /tmp/oldtree ${OLD_REV-60a8ae2}
  cp src/adaserve/bench/overload.py /tmp/oldtree/src/adaserve/bench/overload.py
fi
for n in ${RUNS-1 2 3 4 5}; do
  PYTHONPATH=/tmp/oldtree/src OUT=$D/${AB-ab}-old RUNS=$n bash docs/results/raw/admission-cpu-twelfth/retry.sh
  OUT=$D/${AB-ab}-new RUNS=$n bash docs/results/raw/admission-cpu-twelfth/retry.sh
done
