"""The dashboard page: one self-contained HTML file, live (``adaserve serve``'s
``/dashboard``) or static (``adaserve bench``'s ``report.html``).

The page inlines the vendored charting library (uPlot, ``assets/uplot``, MIT licence
beside it) and its own script and style (``assets/dashboard``); it loads nothing from
anywhere else. Its data is one "view" dict (``view``): per SLO class the report's
counts, attainment (since start and rolling), TTFT / TPOT percentiles and targets and
verification use, the recent per-iteration means; overall the engine gauges,
acceptance by position, sheds and fallbacks by reason, per-tenant usage and the
iteration timeline (``server.iterations.timeline_series``'s columns).

A live page carries no data: it polls ``data_url`` with the session cookie its sign-in
form obtained (``server.dashboard``); a sign-in page (``mode: "signin"``) is the form
alone. A static page embeds its views (one per run).
Torch-free (the benchmark's report writer imports it).
"""

from __future__ import annotations

import json
import math
import re
from importlib import resources

from adaserve.util.jsonsafe import json_safe

ROLLING_WINDOW_S = 60.0
RECENT_ITERATIONS = 120  # the per-iteration means in the class table cover these

SERIES_KEYS = ("t", "running", "waiting", "kv_usage", "depth", "budget", "tokens")
CLASS_SERIES = {  # the view's per-class column -> the timeline sample's key
    "tree_per_req": "tree_by_class",
    "accepted_per_req": "accepted_by_class",
    "budget_share": "budget_share_by_class",
}

_ASSETS = resources.files("adaserve") / "assets"


def _asset(*parts: str) -> str:
    return _ASSETS.joinpath(*parts).read_text(encoding="utf-8")


def _mean(values) -> float | None:
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    return sum(v) / len(v) if v else None


def timeline_series(samples: list[dict], classes) -> dict:
    """Column arrays of timeline ``samples`` (``core.trace.sample`` dicts): the overall
    series in ``SERIES_KEYS`` and, per class, its mean tree nodes and accepted tokens
    per request and its share of B in each iteration (None where the class had no
    request in that pass, or the plan set no budget)."""
    out: dict = {k: [s.get(k) for s in samples] for k in SERIES_KEYS}
    for key, src in CLASS_SERIES.items():
        out[key] = {c: [(s.get(src) or {}).get(c) for s in samples] for c in classes}
    return out


def acceptance_by_position(accepted_per_pos: dict, drafts: int) -> list[dict]:
    """Per speculated position (0 = first): accepted draft tokens and their rate per
    request-iteration that verified a draft (vLLM's per-position acceptance)."""
    out = []
    for pos, n in sorted((int(k), int(v)) for k, v in (accepted_per_pos or {}).items()):
        out.append({"position": pos, "accepted": n, "rate": n / drafts if drafts else None})
    return out


def view(
    *,
    title: str,
    model: str | None,
    policy: str | None,
    as_of_s: float,
    classes: dict[str, dict],
    engine: dict,
    accepted_per_pos: dict,
    spec_drafts: int,
    shed: dict,
    fallback_iterations: dict,
    tenants: dict,
    timeline: dict,
    rolling_window_s: float = ROLLING_WINDOW_S,
    recent_timeline: dict | None = None,
    replicas: dict | None = None,
    timeline_replica: str | None = None,
) -> dict:
    """The page's data. ``classes``: name -> {targets, requests, attained, attainment,
    rolling {requests, attained, attainment}, ttft_ms, tpot_ms (p50/p95/p99),
    verification {tree_nodes, accepted_tokens, share}}; ``tenants``: name -> {requests,
    prompt_tokens, completion_tokens, charge, rate_limited}; ``timeline``: column
    arrays. Adds each class's means over the newest ``RECENT_ITERATIONS`` samples of
    ``recent_timeline`` (default: ``timeline``). ``replicas`` (a service of replicas):
    replica id -> {live, running, waiting, kv_usage, iterations, timeline}, the charts
    showing ``timeline_replica``'s first."""
    cls_out = []
    for name, c in classes.items():
        recent = {}
        for key in ("tree_per_req", "accepted_per_req", "budget_share"):
            col = ((recent_timeline or timeline).get(key) or {}).get(name) or []
            recent[key] = _mean(col[-RECENT_ITERATIONS:])
        cls_out.append({"name": name, **c, "recent": recent})
    return json_safe(
        {
            "object": "dashboard",
            "title": title,
            "model": model,
            "policy": policy,
            "as_of_s": as_of_s,
            "rolling_window_s": rolling_window_s,
            "recent_iterations": RECENT_ITERATIONS,
            "classes": cls_out,
            "engine": engine,
            "acceptance_by_position": acceptance_by_position(accepted_per_pos, spec_drafts),
            "spec_drafts": spec_drafts,
            "shed": dict(shed),
            "fallback_iterations": dict(fallback_iterations),
            "tenants": tenants,
            "timeline": timeline,
            **(
                {"replicas": replicas, "timeline_replica": timeline_replica}
                if replicas is not None
                else {}
            ),
        }
    )


def _script_json(obj) -> str:
    """JSON that is safe inside a ``<script>`` element."""
    s = json.dumps(obj, allow_nan=False, separators=(",", ":"))
    return s.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render(boot: dict, title: str = "adaserve dashboard") -> str:
    """The page. ``boot``: {"mode": "live", "data_url", "session_url", "interval_ms",
    "session"}, {"mode": "signin", "session_url", "message"} or {"mode": "static",
    "runs": [view, ...]}."""
    html = _asset("dashboard", "dashboard.html")
    parts = {
        "{{TITLE}}": _escape(title),
        "{{UPLOT_CSS}}": _asset("uplot", "uPlot.min.css"),
        "{{DASH_CSS}}": _asset("dashboard", "dashboard.css"),
        "{{BOOT}}": _script_json(boot),
        "{{UPLOT_JS}}": _asset("uplot", "uPlot.iife.min.js").replace("</script", "<\\/script"),
        "{{DASH_JS}}": _asset("dashboard", "dashboard.js"),
    }
    # one pass: nothing inserted is scanned for placeholders again
    return re.sub(r"\{\{[A-Z_]+\}\}", lambda m: parts.get(m.group(0), m.group(0)), html)


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
