"""Admission on against off in the simulator (issue 31's goals), seeds side by side.

For each rate and seed, runs ``adaserve simulate`` with and without ``--admission``
on the reference workload (``docs/results/pass-composition.md``'s ``$REF``, mix
50/25/25) and prints, per rate: refused %, attainment over all requests, attainment of
the admitted requests per class, goodput, and goodput on / off.

    python benchmarks/admission_sim.py --rates 1.3,4.9 --seeds 1-3 [--duration 180]

The simulator is deterministic: the figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REF = [
    "--preset", "A100-80GB:llama-70b", "--dataset", "random", "--trace", "azure-conv",
    "--class-mix", "interactive:0.5,chat:0.25,batch:0.25",
    "--input-len", "interactive=lognormal:200:0.5:1024",
    "--input-len", "chat=lognormal:300:0.8:2048",
    "--input-len", "batch=lognormal:1500:0.5:4096",
    "--output-len", "interactive=lognormal:150:0.5:512",
    "--output-len", "chat=lognormal:200:0.7:1024",
    "--output-len", "batch=lognormal:150:0.5:512",
]  # fmt: skip


def _seeds(s: str) -> list[int]:
    if "-" in s:
        a, b = s.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in s.split(",")]


def run_one(rate: float, seed: int, admission: bool, duration: float, policy: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable, "-m", "adaserve", "simulate", *REF,
            "--request-rate", str(rate), "--duration", str(duration), "--seeds", str(seed),
            "--policies", policy, "--no-plots", "--no-progress", "--out", out,
        ] + (["--admission"] if admission else [])  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True)
        res = json.loads((Path(out) / "result.json").read_text())["results"][policy]
        recs = [json.loads(x) for x in (Path(out) / "requests.jsonl").read_text().splitlines()]
        res["_records"] = {r["idx"]: (r["shed"], r["attained"]) for r in recs}
        return res


def would_have_met(on: list[dict], off: list[dict]) -> tuple[int, int]:
    """(refused with admission on, of them met their SLO in the same seed's run with
    admission off): the simulator knows what a refusal cost."""
    refused = met = 0
    for a, b in zip(on, off):
        for idx, (shed, _) in a["_records"].items():
            if shed:
                refused += 1
                met += bool(b["_records"].get(idx, (False, False))[1])
    return refused, met


def summarize(runs: list[dict]) -> dict:
    tot = {"requests": 0, "shed": 0, "attained": 0, "goodput": 0.0}
    cls: dict[str, list[int]] = {}
    reasons: dict[str, int] = {}
    for r in runs:
        o = r["overall"]
        tot["requests"] += o["requests"]
        tot["shed"] += o["shed"]
        tot["attained"] += o["attained"]
        tot["goodput"] += o["goodput_tok_s"] / len(runs)
        for k, v in (o.get("shed_by_reason") or {}).items():
            reasons[k] = reasons.get(k, 0) + v
        for name, c in r["per_class"].items():
            a = cls.setdefault(name, [0, 0])
            a[0] += c["attained"]
            a[1] += c["requests"] - c["shed"]
    return {
        "refused_pct": 100.0 * tot["shed"] / max(tot["requests"], 1),
        "attain_all_pct": 100.0 * tot["attained"] / max(tot["requests"], 1),
        "admitted_pct": {k: 100.0 * a / max(n, 1) for k, (a, n) in cls.items()},
        "admitted_all_pct": 100.0
        * sum(a for a, _ in cls.values())
        / max(sum(n for _, n in cls.values()), 1),
        "goodput": tot["goodput"],
        "reasons": reasons,
        "admission": [r["overall"].get("admission") for r in runs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", default="1.3,4.9")
    ap.add_argument("--seeds", default="1-3")
    ap.add_argument("--duration", type=float, default=180.0)
    ap.add_argument("--policy", default="adaserve")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", help="write the summaries here")
    a = ap.parse_args()
    rates = [float(x) for x in a.rates.split(",")]
    seeds = _seeds(a.seeds)
    jobs = [(r, s, adm) for r in rates for adm in (True, False) for s in seeds]
    with ThreadPoolExecutor(a.jobs) as ex:
        res = list(ex.map(lambda j: run_one(j[0], j[1], j[2], a.duration, a.policy), jobs))
    by: dict[tuple, list] = {}
    for (r, _, adm), out in zip(jobs, res):
        by.setdefault((r, adm), []).append(out)
    rows = []
    print("| req/s | admission | refused % | SLO ok % (all) | admitted ok %: per class | "
          "admitted all % | goodput tok/s | on/off |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rates:
        on, off = summarize(by[(r, True)]), summarize(by[(r, False)])
        for name, s in (("on", on), ("off", off)):
            per = " / ".join(f"{k} {v:.1f}" for k, v in s["admitted_pct"].items())
            ratio = f"{on['goodput'] / max(off['goodput'], 1e-9):.2f}x" if name == "on" else ""
            print(
                f"| {r} | {name} | {s['refused_pct']:.1f} | {s['attain_all_pct']:.1f} | {per} | "
                f"{s['admitted_all_pct']:.1f} | {s['goodput']:.0f} | {ratio} |"
            )
            row = {k: v for k, v in s.items() if k != "admission"}
            rows.append({**row, "rate": r, "admission": name})
        refused, met = would_have_met(by[(r, True)], by[(r, False)])
        on["refused_would_have_met"] = met
        pred = [
            (c["predicted_attainment"], c["realised_attainment"], c["promised_n"])
            for run in on["admission"]
            for name, c in (run or {}).items()
            if name == "interactive" and "promised_n" in c
        ]
        n = sum(p[2] for p in pred)
        promised = (
            f"; interactive promised {sum(p[0] * p[2] for p in pred) / n:.3f}, "
            f"realised {sum(p[1] * p[2] for p in pred) / n:.3f} over {n}"
            if n
            else ""
        )
        print(
            f"  refusals by reason (on): {on['reasons']}; {met} of {refused} refused "
            f"would have met their SLO with admission off{promised}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
