#!/usr/bin/env bash
# issue 31, twelfth pass: retrying clients, the code before this pass (a worktree of
# OLD_REV at /tmp/oldtree, put first on PYTHONPATH) alternated with this pass's, a fresh
# server per run (retry.sh).
set -u
D=docs/results/raw/admission-cpu-twelfth
cd "$(dirname "$0")/../../../.."
[ -d /tmp/oldtree ] || git worktree add /tmp/oldtree ${OLD_REV-5ed808f}
for n in ${RUNS-7 8 9}; do
  PYTHONPATH=/tmp/oldtree/src OUT=$D/${AB-ab}-old RUNS=$n bash $D/retry.sh
  OUT=$D/${AB-ab}-new RUNS=$n bash $D/retry.sh
done
