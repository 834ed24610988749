"""Where the strict class's misses come from: each admitted interactive request's company
at admission, the decoders beside it over its life, the passes' speed (measured over the
profile's prediction) over its life, and its drafts' acceptance. Usage: an_miss.py DIR"""
import bisect
import glob
import gzip
import json
import statistics as st
import sys

for path in sorted(glob.glob(sys.argv[1] + "/miss-*.jsonl*")):
    ev = [json.loads(x) for x in (gzip.open(path, "rt") if path.endswith(".gz") else open(path))]
    steps = [e for e in ev if e["ev"] == "s"]
    ts = [e["t"] for e in steps]
    adm = {e["rid"]: e for e in ev if e["ev"] == "a"}
    rows = []
    for e in ev:
        if e["ev"] != "f" or e["cls"] != "interactive" or e["tpot"] is None:
            continue
        a = adm.get(e["rid"])
        if a is None:
            continue
        i, j = bisect.bisect_right(ts, e["first"]), bisect.bisect_right(ts, e["t"])
        life = steps[i:j]
        mine = [s for s in life if str(e["rid"]) in s["acc"]]
        if not mine:
            continue
        dec = st.mean(sum(s["dec"].values()) for s in mine)
        strict = st.mean(s["dec"].get("interactive", 0) for s in mine)
        speed = st.median(s["ms"] / s["pred"] for s in mine if s["pred"])
        acc = st.mean(1 + s["acc"][str(e["rid"])] for s in mine)
        pre = sum(1 for s in mine if s["pre"] > 0) / len(mine)
        rows.append(dict(met=e["tpot"] <= e["target"], tpot=e["tpot"], beside=a["beside"],
                         run=a["run"], dec=dec, strict=strict, speed=speed, acc=acc,
                         pre=pre, ms=st.mean(s["ms"] for s in mine), t=a["t"]))
    print(path, len(rows), "interactive; met", sum(r["met"] for r in rows))
    def show(name, key, edges):
        for lo, hi in zip(edges, edges[1:]):
            g = [r for r in rows if lo <= key(r) < hi]
            if g:
                print(f"  {name} [{lo},{hi}): n={len(g):3d} met={100*sum(r['met'] for r in g)/len(g):5.1f}%"
                      f" tpot={st.median(r['tpot'] for r in g):5.2f} acc={st.mean(r['acc'] for r in g):4.2f}"
                      f" pass={st.mean(r['ms'] for r in g):5.1f} speed={st.mean(r['speed'] for r in g):4.2f}")
    show("beside", lambda r: r["beside"] or 0, [0, 1, 2, 3, 10])
    show("run@adm", lambda r: r["run"], [0, 1, 2, 3, 10])
    show("decoders", lambda r: r["dec"], [1, 1.5, 2, 2.5, 3, 10])
    show("strict dec", lambda r: r["strict"], [1, 1.2, 1.5, 2, 10])
    show("speed", lambda r: r["speed"], [0, 1.1, 1.3, 1.5, 1.7, 5])
    show("acc/pass", lambda r: r["acc"], [0, 1.2, 1.4, 1.6, 1.8, 2.0, 9])
    show("prefill share", lambda r: r["pre"], [0, 0.05, 0.15, 0.3, 1.01])
