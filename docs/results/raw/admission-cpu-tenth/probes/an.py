import json, sys, numpy as np
def load(p):
    reqs, steps = [], []
    for l in open(p):
        d = json.loads(l)
        if "req" in d:
            reqs.append((d, steps)); steps = []
        else:
            steps.append(d)
    return reqs
for p in sys.argv[1:]:
    R = load(p)
    tp = []
    for d, st in R:
        dec = st[1:]
        tp.append(sum(s["ms"] for s in dec) / max(1, d["ntok"] - 1))
    tp = np.array(tp)
    print(p, "TPOT p10/50/90/95/max", np.percentile(tp, [10, 50, 90, 95, 100]).round(2), "over 11.33:", (tp > 11.33).mean())
