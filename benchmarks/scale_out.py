"""SLO capacity of rate sweeps side by side, and each row's ratio to a reference: the
figures of ``docs/results/scale-out-sim.md``.

Each RESULT is a ``result.json`` of ``adaserve simulate --sweep rate`` (one replica, or
``--replicas N`` with one or several routers). The points of every file are pooled by
row (policy, or POLICY@ROUTER) and rate, a later file's point replacing an earlier one
at the same rate, so sweeps run in parts (other rates, other routers) join up; each
row's capacity is then ``bench.capacity.slo_capacity``'s over all its rates, listed
with the overall and strictest class's attainment at each rate and its capacity over
the reference row's (``--reference``, default the first row)::

    .venv/bin/python benchmarks/scale_out.py R8/result.json R8_26/result.json \\
        --reference adaserve@p2c
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from adaserve.bench.capacity import slo_capacity


def pooled(paths: list[Path]) -> dict[str, dict[float, dict]]:
    """{row: {rate: its result}} over every file."""
    out: dict[str, dict[float, dict]] = {}
    for path in paths:
        res = json.loads(path.read_text())
        for p in res["points"]:
            for name, r in p["results"].items():
                out.setdefault(name, {})[float(p["x"])] = r
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--reference", default=None, help="the row capacities are divided by")
    args = ap.parse_args(argv)
    try:
        rows = pooled(args.results)
    except (OSError, ValueError, KeyError) as e:
        print(f"scale_out: not a rate sweep's result.json ({e})", file=sys.stderr)
        return 2
    if not rows:
        print("scale_out: no rows", file=sys.stderr)
        return 2
    ref = args.reference or next(iter(rows))
    if ref not in rows:
        print(f"scale_out: no row {ref!r}; rows: {', '.join(rows)}", file=sys.stderr)
        return 2
    caps = {}
    for name, by_x in rows.items():
        pts = [{"x": x, "results": {name: r}} for x, r in sorted(by_x.items())]
        cap = slo_capacity(pts)
        caps[name] = (cap["policies"][name], cap["strict_class"])
    base = caps[ref][0]["capacity_rps"]
    for name, by_x in rows.items():
        c, strict = caps[name]
        cap = c["capacity_rps"]
        ratio = f"{cap / base:.2f}x" if cap and base else "-"
        shown = "< lowest" if cap is None else f"{cap:g}{'+' if c['at_highest'] else ''}"
        cells = []
        for x, r in sorted(by_x.items()):
            s = r["per_class"].get(strict, {}).get("attainment") if strict else None
            o = r["overall"]["attainment"]
            gp = r["overall"]["goodput_tok_s"]
            cells.append(f"{x:g}: {100 * o:.1f}/{'-' if s is None else f'{100 * s:.1f}'} {gp:.0f}")
        print(f"{name:14s} capacity {shown:>8s}  vs {ref}: {ratio:>6s}   " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
