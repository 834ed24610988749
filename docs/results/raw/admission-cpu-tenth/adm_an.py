import json, sys, numpy as np
for p in sys.argv[1:]:
    adm, fin = {}, {}
    for l in open(p):
        d = json.loads(l)
        (adm if d["ev"] == "adm" else fin)[d["rid"]] = d
    rows = []
    for rid, a in adm.items():
        if a["cls"] != "interactive" or rid not in fin: continue
        f = fin[rid]
        rows.append((a["t"], a["promise"], a["pred"], a["err"], a["run"], a["wait"], a["tr"], a["tok"], f["tpot"], f["target"], f["n"]))
    rows.sort()
    t0 = rows[0][0]
    miss = [r for r in rows if r[8] > r[9]]
    print(p, "interactive", len(rows), "miss", len(miss))
    for grp, name in ((lambda r: r[1] is None, "no promise"), (lambda r: r[1] is not None, "promised")):
        g = [r for r in rows if grp(r)]
        if g: print(f"  {name}: n={len(g)} miss={sum(r[8]>r[9] for r in g)} tpot/target p50={np.median([r[8]/r[9] for r in g]):.2f}")
    print("  t  promise pred err run wait tr tok | tpot")
    for r in rows:
        if r[8] > r[9] or r[1] is not None and r[2] and r[2] > 0.85 * r[9]:
            print(f"  {r[0]-t0:6.1f} {r[1]} pred={r[2] and round(r[2],2)} err={r[3] and round(r[3],2)} run={r[4]} wait={r[5]} tr={r[6] and round(r[6],2)} tok={r[7] and round(r[7],2)} | tpot={r[8]:.2f} {'MISS' if r[8]>r[9] else ''}")

def phase(p, t_from=5.5):
    adm, fin = {}, {}
    for l in open(p):
        d = json.loads(l)
        (adm if d["ev"] == "adm" else fin)[d["rid"]] = d
    t0 = min(a["t"] for a in adm.values() if a["cls"] == "interactive")
    out = {}
    for rid, a in adm.items():
        if a["cls"] != "interactive" or rid not in fin or a["t"] - t0 < t_from: continue
        f = fin[rid]
        key = "promised" if a["promise"] is not None else "unpromised"
        o = out.setdefault(key, [0, 0, []])
        o[0] += 1; o[1] += f["tpot"] > f["target"]; o[2].append(f["tpot"] / f["target"])
    for k, (n, m, r) in out.items():
        print(f"   load phase {k}: n={n} miss={m} ratio p10/50/90={np.percentile(r,[10,50,90]).round(2)}")
if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(p); phase(p)
