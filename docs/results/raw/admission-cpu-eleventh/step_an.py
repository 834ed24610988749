"""Where a strict request's TPOT goes: per finished request, its decode steps' pass
time, the loop's time between them, and its tokens per step (STEP_LOG lines)."""
import json
import sys

import numpy as np

for p in sys.argv[1:]:
    steps, fins = [], []
    for line in open(p):
        d = json.loads(line)
        (steps if d["ev"] == "step" else fins).append(d)
    steps.sort(key=lambda s: s["t0"])
    rows = []
    for fi in fins:
        if fi["cls"] != "interactive":
            continue
        rid = str(fi["rid"])
        mine = [s for s in steps if fi["first"] <= s["te"] <= fi["end"] + 1e-9 and rid in s["acc"]]
        span = [s for s in steps if fi["first"] < s["te"] <= fi["end"] + 1e-9]
        if not mine:
            continue
        tpot = (fi["end"] - fi["first"]) * 1000 / (fi["n"] - 1)
        passes = sum(s["te"] - s["ts"] for s in span) * 1000
        outside = (fi["end"] - fi["first"]) * 1000 - passes
        tps = np.mean([s["acc"][rid] + 1 for s in mine])
        pt = np.mean([(s["te"] - s["ts"]) * 1000 for s in span])
        ratio = np.mean([(s["te"] - s["ts"]) * 1000 / s["pred"] for s in span if s["pred"]])
        ndec = np.mean([len(s["dec"]) for s in span])
        pre = np.mean([sum(s["pre"].values()) for s in span])
        cmd = sum(s["cmd"] for s in span) * 1000
        rows.append((tpot / fi["target"], tpot, len(mine), len(span), tps, pt, ratio, outside / (fi["n"] - 1), cmd / (fi["n"] - 1), ndec, pre))
    rows.sort()
    a = np.array(rows)
    hdr = "tpot/tgt tpot mine span tok/step pass_ms pass/pred out_ms/tok cmd_ms/tok ndec prefill"
    print(p, len(rows), "interactive;", "miss", int((a[:, 0] > 1).sum()))
    print(hdr)
    for q, name in ((a[:, 0] <= 0.8, "<=0.8"), ((a[:, 0] > 0.8) & (a[:, 0] <= 1), "0.8-1"), (a[:, 0] > 1, "miss")):
        if q.any():
            print(name, np.round(a[q].mean(0), 2), int(q.sum()))
    for r in rows:
        if r[0] > 0.95:
            print(np.round(r, 2))
    allsteps = np.array([(s["te"] - s["ts"]) * 1000 for s in steps])
    gaps = np.array([(b["t0"] - a_["t1"]) * 1000 for a_, b in zip(steps, steps[1:])])
    print("pass ms p50/p90", np.percentile(allsteps, [50, 90]).round(2), "gap ms p50/p90/p99/max", np.percentile(gaps, [50, 90, 99, 100]).round(2),
          "cmd ms total", round(sum(s["cmd"] for s in steps) * 1000), "pub", round(sum(s["pub"] for s in steps) * 1000),
          "steps", len(steps), "span s", round(steps[-1]["t1"] - steps[0]["t0"], 1))
