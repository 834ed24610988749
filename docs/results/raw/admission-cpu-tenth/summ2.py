import json, sys, glob, statistics as S
for d in sys.argv[1:]:
    ia, gp, dr, pr = [], [], [], []
    for n in range(1, 6):
        try:
            j = json.load(open(f"{d}/run-{n}.json")); r = json.load(open(f"{d}/run-{n}.report.json"))
        except Exception:
            continue
        ia.append(100 * j["classes"]["interactive"]["admitted_attainment"])
        gp.append(j["overall"]["goodput_tok_s"])
        dr.append(r["engine"]["drift"]["median_ratio"])
        a = r["engine"]["admission"]["interactive"]; pr.append((a["promised_n"], a["predicted_attainment"], a["realised_attainment"]))
    print(d.split("/")[-1], "interactive", [round(x, 1) for x in ia], "mean", round(S.mean(ia), 1),
          "| goodput", [round(x) for x in gp], "mean", round(S.mean(gp)), "| drift", [round(x, 2) for x in dr], "median", round(S.median(dr), 2))
    print("   promised n/pred/real", pr)
