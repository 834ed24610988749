"""Per run: the simulator on the engine's profile at that run's measured speed (its passes'
median measured / profiled time, ``pass_speed_p50``), the same workload and seed, against
the engine's run; per class attainment (points) and goodput (relative).

    python3 docs/results/raw/engine-issue30-fifteenth/per_run_sim.py NAME RATE SEED [MIX]

MODE=none|median|gap|trace: the profile alone; at the run's median pass speed; that
with the host's time between passes; the run's speed trace (start to start, per second).
Reads e-NAME/result.json (E=DIR: DIR/e-NAME), writes s-NAME-runs-MODE.json and prints a table. Run it alone.
"""

import glob
import json
import os
import subprocess
import sys
import tempfile

D = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(D, "../../../.."))
name, rate, seed = sys.argv[1], sys.argv[2], sys.argv[3]
mix = sys.argv[4] if len(sys.argv) > 4 else ""
profile = glob.glob(os.path.expanduser("~/.cache/adaserve/profiles/*-cpu-float32-*-1t-f7.json"))[0]
E = os.environ.get("E", D)
eng = json.load(open(f"{E}/e-{name}/result.json"))["results"]
rows = []
for pol, s in eng.items():
    for k, rep in enumerate(s["overall"]["repeats"]):
        speed = rep["pass_speed_p50"]
        mode = os.environ.get("MODE", "median")
        trace = {"t_s": [0.0], "factor": [speed]}
        if mode == "gap":  # the host's time between passes too (bench.replayed)
            speed /= 1.0 - rep["replayed"]["between_passes"]
            trace = {"t_s": [0.0], "factor": [speed]}
        elif mode == "trace":  # the run's own speed over time, start to start
            trace = rep["speed_trace"]
            speed = sorted(trace["factor"])[len(trace["factor"]) // 2]
        elif mode == "none":  # the profile alone
            speed, trace = 1.0, {"t_s": [0.0], "factor": [1.0]}
        with tempfile.TemporaryDirectory() as tmp:
            st = os.path.join(tmp, "speed.json")
            json.dump(trace, open(st, "w"))
            cmd = [f"{ROOT}/.venv/bin/adaserve", "simulate", "--profile", profile,
                   "--stats", f"{ROOT}/src/adaserve/assets/pair_stats.json",
                   "--selection-time", "measured", "--request-rate", rate, "--duration", "20",
                   "--seed", seed, "--policies", pol, "--speed-trace", st, "--out", tmp + "/o"]
            if mix:
                cmd += ["--class-mix", mix]
            subprocess.run(cmd, check=True, capture_output=True)
            sim = json.load(open(f"{tmp}/o/result.json"))["results"][pol]
        row = {"policy": pol, "run": k + 1, "speed": speed,
               "engine": {"overall": rep["attainment"], "goodput": rep["goodput_tok_s"],
                          **rep["per_class_attainment"]},
               "sim": {"overall": sim["overall"]["attainment"],
                       "goodput": sim["overall"]["goodput_tok_s"],
                       **{c: m["attainment"] for c, m in sim["per_class"].items()}}}
        rows.append(row)
        e, m = row["engine"], row["sim"]
        classes = [c for c in e if c not in ("overall", "goodput")]
        diffs = {c: 100 * (m.get(c, 0) - e[c]) for c in ["overall", *classes]}
        g = m["goodput"] / e["goodput"] - 1 if e["goodput"] else float("nan")
        ok = all(abs(v) <= 5 for v in diffs.values()) and abs(g) <= 0.15
        print(f"{pol:13s} run {k+1} speed {speed:.2f}  " +
              "  ".join(f"{c} {100*e[c]:.1f}/{100*m.get(c,0):.1f}" for c in ["overall", *classes]) +
              f"  goodput {e['goodput']:.0f}/{m['goodput']:.0f} ({100*g:+.0f}%)  {'MET' if ok else 'not met'}")
json.dump(rows, open(f"{E}/s-{name}-runs-{os.environ.get('MODE', 'median')}.json", "w"), indent=1)
