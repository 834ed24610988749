"""Offline: the draft-stop rule on logged lone steps. Per step: tree f/depth/parents
(all drafted nodes), accepted count, ms. Rule: after drafting level t, continue iff
sum(f at level t) * A >= thr. Saved: (d - t) draft passes (1.2 ms each) and the
verified nodes beyond level t (s ms each); accepted capped at t."""
import json, sys, numpy as np
p = sys.argv[1]
rows = [json.loads(l) for l in open(p)]
steps = [r for r in rows if "ms" in r and r.get("drafts")]
CD, S = 1.2, 0.42
for thr in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7):
    T0 = T1 = A0 = A1 = 0.0
    for r in steps:
        for rid, (f, depth, par) in r["drafts"].items():
            f = np.array(f); depth = np.array(depth)
            d = int(depth.max())
            acc = r["acc"].get(rid, 0)
            nodes = r["nodes"].get(rid, len(f) - 1)
            t = d
            for lev in range(1, d):
                if f[depth == lev].sum() < thr:
                    t = lev; break
            cut_nodes = int((depth > t).sum())
            saved = (d - t) * CD + min(cut_nodes, nodes) * S
            T0 += r["ms"]; T1 += r["ms"] - saved
            A0 += 1 + acc; A1 += 1 + min(acc, t)
    print(f"thr {thr}: ms/token {T0/A0:.3f} -> {T1/A1:.3f}")
