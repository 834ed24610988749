"""The comparison figures of a rate sweep against its baselines, per rate.

For the policy under test (default ``adaserve``) at every swept rate:
- goodput / the best baseline's goodput, over "all" baselines and over the paper's
  own set (ar, ar-chunked, spec-chain:4/6/8, spec-tree);
- violations of the baseline with the highest attainment / the policy's violations;
- goodput as a share of each oracle's.
Baselines are the policies not named ``adaserve*`` or ``oracle*``::

    .venv/bin/python benchmarks/sweep_goals.py OUT/result.json [--policy adaserve]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adaserve.bench.capacity import is_baseline

PAPER_SET = ("ar", "ar-chunked", "spec-chain:4", "spec-chain:6", "spec-chain:8", "spec-tree")


def _ratios(me: dict, results: dict, names: list[str]) -> tuple[str, float, str, float]:
    """(best-goodput baseline, goodput ratio, best-attainment baseline, violation ratio)."""
    by_gp = max(names, key=lambda p: results[p]["overall"]["goodput_tok_s"])
    by_att = max(names, key=lambda p: results[p]["overall"]["attainment"])
    gp = me["overall"]["goodput_tok_s"] / results[by_gp]["overall"]["goodput_tok_s"]
    mine = 1.0 - me["overall"]["attainment"]
    theirs = 1.0 - results[by_att]["overall"]["attainment"]
    viol = theirs / mine if mine > 0 else float("inf")
    return by_gp, gp, by_att, viol


def rows(result: dict, policy: str) -> list[dict]:
    """One dict of comparison figures per swept point."""
    out = []
    for pt in result["points"]:
        res = pt["results"]
        if policy not in res:
            raise KeyError(f"no results for {policy!r} at x = {pt['x']}")
        me = res[policy]
        base = [p for p in res if is_baseline(p)]
        paper = [p for p in base if p in PAPER_SET]
        row = {"x": pt["x"], "attainment": me["overall"]["attainment"]}
        for label, names in (("all", base), ("paper", paper)):
            if names:
                g, gr, a, vr = _ratios(me, res, names)
                row[label] = {"goodput_vs": g, "goodput_x": gr, "violations_vs": a, "fewer_x": vr}
        row["oracle_share"] = {
            p: me["overall"]["goodput_tok_s"] / r["overall"]["goodput_tok_s"]
            for p, r in res.items()
            if p.startswith("oracle") and r["overall"]["goodput_tok_s"]
        }
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path)
    ap.add_argument("--policy", default="adaserve")
    a = ap.parse_args(argv)
    try:
        table = rows(json.loads(a.result.read_text()), a.policy)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    head = "| x | attain % | goodput x best (all) | fewer violations x (all) | goodput x best (paper) | fewer violations x (paper) | share of oracles |"
    print(head + "\n|" + "---|" * 7)
    for r in table:
        cells = [f"{r['x']:g}", f"{100 * r['attainment']:.1f}"]
        for label in ("all", "paper"):
            d = r.get(label)
            cells += (
                [
                    f"{d['goodput_x']:.2f} ({d['goodput_vs']})",
                    f"{d['fewer_x']:.1f} ({d['violations_vs']})",
                ]
                if d
                else ["-", "-"]
            )
        cells.append(", ".join(f"{p} {100 * v:.0f}%" for p, v in r["oracle_share"].items()) or "-")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
