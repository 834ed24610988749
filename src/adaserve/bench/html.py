"""``report.html``: the benchmark's results as the live dashboard's page, offline.

One view per policy (a selector switches between them), built from what the report
already holds: the per-class metrics (``bench.metrics.summarize``), the per-iteration
timeline samples (``core.trace.sample``) and the request records. The page inlines the
charting library and the data (``adaserve.util.dashboard_page``), so the one file opens
without a network. A timeline longer than ``MAX_POINTS`` iterations is drawn from
every k-th one. Rolling attainment: the requests that finished in the last
``ROLLING_WINDOW_S`` seconds of the run. Torch-free.
"""

from __future__ import annotations

from pathlib import Path

from adaserve.bench.tables import _class_order
from adaserve.util import dashboard_page

MAX_POINTS = 4000  # a longer timeline is drawn from every k-th iteration


def _get(r, name: str):
    return r.get(name) if isinstance(r, dict) else getattr(r, name, None)


def _rolling(records, cls: str, window_s: float) -> dict:
    """Requests of ``cls`` that finished in the run's last ``window_s`` seconds."""
    done = [r for r in records if _get(r, "finish_s") is not None]
    if not done:
        return {"requests": 0, "attained": 0, "attainment": None}
    since = max(_get(r, "finish_s") for r in done) - window_s
    mine = [r for r in done if _get(r, "cls") == cls and _get(r, "finish_s") >= since]
    good = sum(bool(_get(r, "attained")) for r in mine)
    return {
        "requests": len(mine),
        "attained": good,
        "attainment": good / len(mine) if mine else None,
    }


def bench_views(result: dict, timelines: dict | None, records: dict | None) -> list[dict]:
    """The dashboard views of a ``serve`` result, one per policy."""
    config = result.get("config", {})
    results = result.get("results", {})
    window = dashboard_page.ROLLING_WINDOW_S
    views = []
    for pol, res in results.items():
        per, ov = res.get("per_class", {}), res.get("overall", {})
        names = _class_order([{pol: res}])
        total = sum(per[c].get("verified_tokens") or 0 for c in names)
        classes = {}
        for c in names:
            m = per[c]
            nodes = m.get("verified_tokens") or 0
            classes[c] = {
                "targets": {"tpot_ms": m.get("tpot_target_ms"), "ttft_ms": m.get("ttft_target_ms")},
                "requests": m.get("requests"),
                "attained": m.get("attained"),
                "attainment": m.get("attainment"),
                "rolling": _rolling((records or {}).get(pol, []), c, window),
                "ttft_ms": m.get("ttft_ms", {}),
                "tpot_ms": m.get("tpot_ms", {}),
                "verification": {
                    "tree_nodes": nodes,
                    "accepted_tokens": m.get("accepted_tokens"),
                    "share": nodes / total if total else 0.0,
                },
            }
        samples = (timelines or {}).get(pol) or []
        last = samples[-1] if samples else {}
        stride = -(-len(samples) // MAX_POINTS) if samples else 1
        samples = samples[::stride]
        views.append(
            dashboard_page.view(
                title=f"policy {pol}",
                model=config.get("model"),
                policy=pol,
                as_of_s=ov.get("duration_s") or 0.0,
                classes=classes,
                engine={
                    "running": last.get("running"),
                    "waiting": last.get("waiting"),
                    "kv_usage": last.get("kv_usage"),
                    "iterations": ov.get("iterations"),
                },
                accepted_per_pos=ov.get("accepted_per_pos") or {},
                spec_drafts=ov.get("spec_drafts") or 0,
                shed=ov.get("shed_by_reason") or {},
                fallback_iterations=ov.get("fallback_iterations") or {},
                tenants={},
                timeline=dashboard_page.timeline_series(samples, names),
                rolling_window_s=window,
            )
        )
    return views


def write_html(out: Path, result: dict, timelines: dict | None, records: dict | None) -> Path:
    """Write ``report.html`` to ``out``; returns its path."""
    page = dashboard_page.render(
        {"mode": "static", "runs": bench_views(result, timelines, records)},
        title="adaserve bench report",
    )
    p = Path(out) / "report.html"
    p.write_text(page, encoding="utf-8")
    return p
