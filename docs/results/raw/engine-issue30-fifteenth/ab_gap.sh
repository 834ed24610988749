#!/usr/bin/env bash
# Pairs of in-process runs alternating on/off (ab_gap.py); alone on the machine:
#   PAIRS="1 2 3 4" bash docs/results/raw/engine-issue30-fifteenth/ab_gap.sh
set -eu
cd "$(dirname "$0")/../../../.."
D=docs/results/raw/engine-issue30-fifteenth/ab
mkdir -p $D
for k in ${PAIRS:-1 2 3 4}; do
  if [ $((k % 2)) = 1 ]; then order="on off"; else order="off on"; fi
  for m in $order; do
    .venv/bin/python docs/results/raw/engine-issue30-fifteenth/ab_gap.py $m $D/$m-$k ${RATE:-3.5} ${SEED:-0} > $D/$m-$k.txt 2>&1
  done
done
python3 - "$D" <<'PY'
import json, glob, sys
for m in ("on", "off"):
    rows = []
    for f in sorted(glob.glob(f"{sys.argv[1]}/{m}-*/result.json")):
        o = json.load(open(f))["results"]["adaserve"]
        rows.append((o["overall"]["attainment"], o["per_class"]["interactive"]["attainment"],
                     o["overall"]["goodput_tok_s"], (o["overall"].get("pass_speed") or {}).get("p50")))
    print(m, " | ".join(f"{100*a:.1f}% int {100*i:.1f}% {g:.0f} tok/s x{s}" for a, i, g, s in rows))
PY
