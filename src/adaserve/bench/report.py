"""Write benchmark results: ``result.json``, ``summary.md`` (Markdown tables) and PNG plots.

Files written to ``out_dir``:

- ``result.json``: the result dict (serve: ``{"config", "results": {POLICY: {"overall",
  "per_class"}}}``; sweep: ``{"config", "points": [{"x", "results"}]}``).
- ``summary.md``: overall and per-class tables (sweep: one row per point).
- ``requests.jsonl`` (when records are given): one line per request and policy.
- ``timeline.json`` (when timelines are given): per-iteration samples per policy.
- ``report.html`` (serve): the live dashboard's page with this run's data, one
  self-contained file that opens offline (``adaserve.bench.html``).
- PNGs. serve: ``overview.png`` (attainment and goodput per policy and class),
  ``latency_cdf.png`` (per-class TPOT and TTFT CDFs), ``timeline.png`` (tree size and
  the strict class's rolling attainment over time, shifts marked). sweep:
  ``sweep.png`` (attainment and goodput against x per policy) and
  ``sweep_per_class.png``.

The tables are formatted in ``adaserve.bench.tables``, ``summary.md`` in
``adaserve.bench.markdown``, the plots drawn in ``adaserve.bench.plots``.
"""

from __future__ import annotations

import json
from pathlib import Path

from adaserve.bench.html import write_html
from adaserve.bench.markdown import serve_summary_md, sweep_summary_md
from adaserve.bench.plots import _plot_cdfs, _plot_overview, _plot_sweep, _plot_timeline
from adaserve.bench.tables import format_class_table
from adaserve.util.jsonsafe import json_safe

# the documented entry points (docs/bench.md, "Python API"): the terminal table is
# importable from here too
__all__ = ["format_class_table", "write_report"]


def _dumps(x, **kw) -> str:
    """JSON of x, cleaned (``json_safe``) only when it needs it: the walk over every
    value costs seconds for an hour of simulated requests."""
    try:
        return json.dumps(x, allow_nan=False, **kw)
    except (TypeError, ValueError):  # numpy values, NaN or inf
        return json.dumps(json_safe(x), **kw)


# ---------------------------------------------------------------------- entry point
def write_report(
    out_dir,
    result: dict,
    kind: str = "serve",
    timelines: dict | None = None,
    records: dict | None = None,
    plots: bool = True,
) -> list[Path]:
    """Write ``result.json``, ``summary.md``, ``report.html`` and the PNGs to ``out_dir``;
    returns paths.

    ``timelines``: {policy: [per-iteration samples]} (serve; timeline plot);
    ``records``: {policy: [RequestRecord or dict]} (serve; latency CDFs, rolling
    attainment, ``requests.jsonl``).
    """
    if kind not in ("serve", "sweep"):
        raise ValueError(f"unknown report kind {kind!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    p = out / "result.json"
    p.write_text(_dumps(result, indent=2) + "\n")
    written.append(p)
    p = out / "summary.md"
    p.write_text(serve_summary_md(result) if kind == "serve" else sweep_summary_md(result))
    written.append(p)
    if records:
        p = out / "requests.jsonl"
        with p.open("w") as f:
            for pol, rs in records.items():
                for r in rs:
                    d = r.to_dict() if hasattr(r, "to_dict") else dict(r)
                    f.write(_dumps({"policy": pol, **d}) + "\n")
        written.append(p)
    if timelines:
        p = out / "timeline.json"
        p.write_text(_dumps(timelines) + "\n")
        written.append(p)
    if kind == "serve" and result.get("results"):
        written.append(write_html(out, result, timelines, records))
    if not plots:
        return written
    if kind == "serve":
        if result.get("results"):
            written.append(_plot_overview(out, result))
        if records:
            q = _plot_cdfs(out, result, records)
            if q:
                written.append(q)
        if timelines and any(timelines.values()):
            q = _plot_timeline(out, result, timelines, records)
            if q:
                written.append(q)
    else:
        if result.get("points"):
            written.extend(_plot_sweep(out, result))
    return written
