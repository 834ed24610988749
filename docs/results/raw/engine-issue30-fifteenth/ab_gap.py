"""A/B of the planner learning the host's time between passes (``Scheduler._between_ms``,
`between.patch` here, reverted after this A/B): one in-process bench run of adaserve, with it
(``on``) or without (``off``: the gap taken as 0, as before it). Run with the patch applied (`git apply between.patch`).

    python3 ab_gap.py on|off OUT RATE SEED [MIX]
"""

import sys

from adaserve.core import scheduler

if sys.argv[1] == "off":
    scheduler.Scheduler._between_ms = lambda self, t_start, ms: 0.0
from adaserve.cli import main

args = ["bench", "serve", "--request-rate", sys.argv[3], "--duration", "20", "--seed", sys.argv[4],
        "--policies", "adaserve", "--no-plots", "--no-progress", "--out", sys.argv[2]]
if len(sys.argv) > 5:
    args += ["--class-mix", sys.argv[5]]
sys.exit(main(args))
