"""SLO capacity of rate sweeps side by side, and each one's ratio to a reference: the
figures of ``docs/results/scale-out-sim.md``.

Each RESULT is a ``result.json`` of ``adaserve simulate --sweep rate`` (one replica, or
``--replicas N`` with one or several routers); every row (policy or POLICY@ROUTER)
of every file is listed with its capacity (``bench/capacity.py``), the overall and
strictest class's attainment at each rate, and its capacity over the reference row's
(``--reference``, default the first row)::

    .venv/bin/python benchmarks/scale_out.py R8_SLO/result.json R8_P2C/result.json \\
        R1/result.json --reference adaserve@p2c
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows(path: Path) -> list[tuple[str, dict, dict]]:
    """(row name, capacity entry, {rate: (overall, strict attainment)}) of one file."""
    res = json.loads(path.read_text())
    cap = res.get("capacity") or {}
    strict = cap.get("strict_class")
    out = []
    for name, c in (cap.get("policies") or {}).items():
        att = {}
        for p in res["points"]:
            r = p["results"].get(name)
            if r is None:
                continue
            s = r["per_class"].get(strict, {}).get("attainment") if strict else None
            att[p["x"]] = (r["overall"]["attainment"], s)
        out.append((name, c, att))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--reference", default=None, help="the row capacities are divided by")
    args = ap.parse_args(argv)
    table = []
    for f in args.results:
        try:
            table += [(str(f), *r) for r in rows(f)]
        except (OSError, ValueError, KeyError) as e:
            print(f"scale_out: {f}: not a rate sweep's result.json ({e})", file=sys.stderr)
            return 2
    if not table:
        print("scale_out: no rows", file=sys.stderr)
        return 2
    ref = args.reference or table[0][1]
    caps = {name: c.get("capacity_rps") for _, name, c, _ in table}
    if ref not in caps:
        print(f"scale_out: no row {ref!r}; rows: {', '.join(caps)}", file=sys.stderr)
        return 2
    base = caps[ref]
    for f, name, c, att in table:
        cap = c.get("capacity_rps")
        mark = "" if cap is None else ("+" if c.get("at_highest") else "")
        ratio = f"{cap / base:.2f}x" if cap and base else "-"
        pts = "  ".join(
            f"{x:g}: {100 * o:.1f}/{'-' if s is None else f'{100 * s:.1f}'}"
            for x, (o, s) in sorted(att.items())
        )
        shown = "< lowest" if cap is None else f"{cap:g}{mark}"
        print(f"{name:22s} capacity {shown:>9s}  vs {ref}: {ratio:>6s}   {pts}   ({f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
