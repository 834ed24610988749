"""Summarise `bench overload --json` runs: per run the offered rate, the probed capacity,
the retries admitted, admitted attainment per class and goodput."""
import json
import sys
from pathlib import Path

for p in sorted(Path(sys.argv[1]).glob("run-*.json")):
    if p.name.endswith(".report.json"):
        continue
    d = json.loads(p.read_text())
    o, c = d["overall"], d["classes"]
    ok = {k: round(100 * v["admitted_attainment"], 1) for k, v in c.items() if v.get("admitted")}
    print(p.name, f"rate {d['rate_rps']:.1f} cap {d['capacity_rps']:.1f}",
          f"retries {o.get('retries_admitted')}/{o.get('retries')}",
          "admitted ok", ok, "goodput", round(o.get("goodput_tok_s"), 1), "admitted", o["admitted"], "of", o["requests"])
