"""The engine's runs of one set: per load and policy, each run's attainment, goodput,
interactive attainment, pass speed and replayed TPOT (within 10%, and at the run's speed),
then the means and the comparisons bench printed.

    python3 docs/results/raw/engine-issue30-fifteenth/summ.py DIR
"""

import json
import sys

D = sys.argv[1]
for name in ("l25", "l35", "l4"):
    res = json.load(open(f"{D}/e-{name}/result.json"))
    print(f"== {name}")
    for pol, s in res["results"].items():
        reps = s["overall"]["repeats"]
        f = lambda key, k=100: " / ".join(f"{k * r[key]:.1f}" for r in reps)  # noqa: E731
        inter = " / ".join(f"{100 * r['per_class_attainment'].get('interactive', 0):.1f}" for r in reps)
        rp = [r.get("replayed") or {} for r in reps]
        within = " / ".join(f"{100 * x.get('within', 0):.0f}" for x in rp)
        at = " / ".join(f"{100 * x.get('within_at_speed', 0):.0f}" for x in rp)
        gap = " / ".join(f"{100 * x.get('between_passes', 0):.1f}" for x in rp)
        speed = " / ".join(f"{r['pass_speed_p50']:.2f}" for r in reps)
        print(f"{pol:13s} SLO {f('attainment')}  interactive {inter}  goodput {f('goodput_tok_s', 1)}"
              f"  speed {speed}"
              f"  replayed within 10% {within} (at speed {at}), between passes {gap}%")
    for c in res.get("comparisons", {}).get("pairs", []) if isinstance(res.get("comparisons"), dict) else []:
        print("  ", c)
