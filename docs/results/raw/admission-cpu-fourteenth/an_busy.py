"""The engine's use over a run (MISS_LOG): the share of wall time in passes, decoders per
pass, admissions and finishes per second, by 10 s slices, and per-run totals.
Usage: an_busy.py LOG.jsonl..."""
import gzip
import json
import statistics as st
import sys

for path in sys.argv[1:]:
    ev = [json.loads(x) for x in (gzip.open(path, "rt") if path.endswith(".gz") else open(path))]
    steps = [e for e in ev if e["ev"] == "s"]
    adm = [e for e in ev if e["ev"] == "a"]
    fin = [e for e in ev if e["ev"] == "f"]
    t0 = steps[0]["t"] - steps[0]["ms"] / 1000
    t1 = steps[-1]["t"]
    busy = sum(s["ms"] for s in steps) / 1000
    dec = [sum(s["dec"].values()) for s in steps]
    print(f"{path}: span {t1 - t0:.0f} s busy {busy / (t1 - t0):.2f} decoders/pass {st.mean(dec):.2f}"
          f" admits {len(adm)} retries admitted {sum(a['retry'] for a in adm)}"
          f" tokens/s {sum(1 + sum(s['acc'].values()) for s in steps if s['dec']) / (t1 - t0):.0f}")
    row = []
    for k in range(int((t1 - t0) // 10) + 1):
        lo, hi = t0 + 10 * k, t0 + 10 * (k + 1)
        ss = [s for s in steps if lo <= s["t"] < hi]
        b = sum(s["ms"] for s in ss) / 10000
        d = st.mean(sum(s["dec"].values()) for s in ss) if ss else 0
        a = sum(1 for e in adm if lo <= e["t"] < hi)
        r = sum(1 for e in adm if lo <= e["t"] < hi and e["retry"])
        row.append(f"{10 * k}s busy {b:.2f} dec {d:.2f} adm {a}({r}r)")
    print("   " + " | ".join(row))
