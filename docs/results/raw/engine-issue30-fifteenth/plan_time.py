"""Per pass of an in-process bench run: measured over predicted time, with the planner's
and the selection's time taken out, by kind of pass.

    .venv/bin/python docs/results/raw/engine-issue30-fifteenth/plan_time.py POLICY RATE
"""
import sys, time, collections, statistics as st, tempfile
from adaserve.core import scheduler as S
from adaserve.engine import executor as X, engine as E
rows = []; cur = {}
def wrap(cls, name, key):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter()
        try: return f(*a, **k)
        finally: cur[key] = cur.get(key, 0.0) + time.perf_counter() - t
    setattr(cls, name, g)
wrap(S.Scheduler, "schedule", "schedule")
import adaserve.policies.registry as R
orig_step = E.Engine.step
def step(self):
    cur.clear()
    pol = self.policy
    if not hasattr(pol, "_wrapped"):
        fsel = pol.select
        def sel(*a, **k):
            t = time.perf_counter()
            try: return fsel(*a, **k)
            finally: cur["select"] = cur.get("select", 0.0) + time.perf_counter() - t
        pol.select = sel; pol._wrapped = True
    out = orig_step(self)
    tr = self.last_trace
    if tr is not None and tr.predicted_ms > 0 and cur.get("schedule") is not None:
        rows.append((tr.duration_s * 1000, tr.predicted_ms, cur.get("schedule", 0) * 1000, cur.get("select", 0) * 1000,
                     bool(tr.prefill), max((w for d, w in tr.spec.values()), default=0), len(tr.decode), tr.tokens))
    return out
E.Engine.step = step
from adaserve.cli import main
main(["bench", "serve", "--request-rate", sys.argv[2], "--duration", "15", "--seed", "0", "--policies", sys.argv[1],
      "--no-plots", "--no-progress", "--out", tempfile.mkdtemp()])
def rep(label, rs):
    if not rs: return
    r1 = [d / p for d, p, *_ in rs]; r2 = [(d - s) / p for d, p, s, *_ in rs]; r3 = [(d - s - q) / p for d, p, s, q, *_ in rs]
    print(f"{label:28s} n {len(rs):4d}  measured/pred {st.median(r1):.3f}  less plan {st.median(r2):.3f}  less plan+select {st.median(r3):.3f}  plan ms {st.median([x[2] for x in rs]):.2f} select ms {st.median([x[3] for x in rs]):.2f}  pass ms {st.median([x[0] for x in rs]):.1f}")
rep(sys.argv[1] + " all", rows)
rep("  with prefill", [r for r in rows if r[4]])
rep("  decode only", [r for r in rows if not r[4]])
rep("  decode only, trees w>1", [r for r in rows if not r[4] and r[5] > 1])
rep("  decode only, chains", [r for r in rows if not r[4] and r[5] == 1])
rep("  decode only, no spec", [r for r in rows if not r[4] and r[5] == 0])
