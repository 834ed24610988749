#!/usr/bin/env bash
# issue 31, fourteenth pass: the code before this pass (a worktree of OLD_REV at
# /tmp/oldtree14, put first on PYTHONPATH) alternated with this pass's, a fresh server
# per run. RUN: the run script, ../admission-cpu-eleventh/run.sh (no retrying clients,
# the default) or ../admission-cpu-twelfth/retry.sh; AB: the sets' prefix; RUNS: seeds.
set -u
D=docs/results/raw/admission-cpu-fourteenth
cd "$(dirname "$0")/../../../.."
RUN=${RUN-docs/results/raw/admission-cpu-eleventh/run.sh}
if [ ! -d /tmp/oldtree14 ]; then
  git worktree add /tmp/oldtree14 ${OLD_REV-e33636d}
fi
for n in ${RUNS-1 2 3 4 5}; do
  PYTHONPATH=/tmp/oldtree14/src OUT=$D/${AB-ab}-old RUNS=$n bash $RUN
  OUT=$D/${AB-ab}-new RUNS=$n bash $RUN
done
