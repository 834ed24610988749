"""Merge sweep results that ran the same sweep with different policies into one report.

A sweep over many policies on a 2-core machine is faster as two processes, each with
part of the policy list. This joins their ``result.json`` files point by point (same
sweep, same x values), lets a later file's policy replace an earlier one of the same
name (to re-run one policy after a change), recomputes capacity and the oracle's
goodput share (``bench.capacity.annotate_sweep``), and writes ``result.json``,
``summary.md`` and the plots to OUT::

    .venv/bin/python benchmarks/merge_sweeps.py OUT A/result.json B/result.json [...]
        [--reference oracle:compose] [--policies adaserve,dyn-tree,...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adaserve.bench.capacity import annotate_sweep
from adaserve.bench.report import write_report
from adaserve.bench.tables import format_class_table


def merge(results: list[dict]) -> dict:
    """One sweep result with every policy of ``results`` (later ones win on a name)."""
    base = json.loads(json.dumps(results[0]))
    xs = [p["x"] for p in base["points"]]
    for other in results[1:]:
        if other["config"].get("sweep") != base["config"].get("sweep"):
            raise ValueError("the results are of different sweeps")
        if [p["x"] for p in other["points"]] != xs:
            raise ValueError(f"the results swept different values: {xs} vs others")
        for mine, theirs in zip(base["points"], other["points"]):
            mine["results"].update(theirs["results"])
    pols = list(dict.fromkeys(p for pt in base["points"] for p in pt["results"]))
    base["config"]["policies"] = pols
    for pt in base["points"]:
        pt.pop("goodput_share", None)
    base.pop("capacity", None)
    base.pop("goodput_reference", None)
    return base


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("inputs", type=Path, nargs="+")
    ap.add_argument("--reference", help="the policy goodput shares are taken against")
    ap.add_argument("--policies", help="keep only these (comma-separated), in this order")
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)
    try:
        results = [json.loads(p.read_text()) for p in a.inputs]
        merged = merge(results)
        if a.policies:
            keep = [p for p in a.policies.split(",") if p]
            missing = [p for p in keep if p not in merged["config"]["policies"]]
            if missing:
                raise ValueError(f"no results for {missing}")
            for pt in merged["points"]:
                pt["results"] = {p: pt["results"][p] for p in keep}
            merged["config"]["policies"] = keep
        merged = annotate_sweep(merged, a.reference)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_report(a.out, merged, "sweep", plots=not a.no_plots)
    print(format_class_table(merged))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
