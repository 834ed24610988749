"""Text formatting of benchmark results: numbers, Markdown and terminal tables.

The per-class terminal table (``format_class_table``, also the sweep's table), the
helpers the Markdown summary and the plots share (class order, sweep policies) and the
trace attribution every output carries when the Azure trace was used.
"""

from __future__ import annotations

import math

AZURE_ATTRIBUTION = (
    "Arrivals: Azure LLM inference trace 2023 (CC-BY 4.0), Patel et al., "
    '"Splitwise", ISCA 2024; github.com/Azure/AzurePublicDataset'
)


def _uses_azure(config: dict) -> bool:
    t = config.get("trace") or ""
    return "azure" in str(t).lower()


# ---------------------------------------------------------------------- formatting
def _f(v, fmt: str = "{:.1f}", none: str = "-") -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    return fmt.format(v)


def _pct(v) -> str:
    return _f(None if v is None else 100.0 * v, "{:.1f}")


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.rjust(w[i]) if i else h.ljust(w[i]) for i, h in enumerate(header))]
    out.append("  ".join("-" * x for x in w))
    for r in rows:
        out.append("  ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(r)))
    return "\n".join(out)


def _class_order(result_sets: list[dict]) -> list[str]:
    order: list[str] = []
    for res in result_sets:
        for pol in res.values():
            for c in pol.get("per_class", {}):
                if c not in order:
                    order.append(c)
    pref = ["interactive", "chat", "batch"]
    return sorted(order, key=lambda c: (pref.index(c) if c in pref else len(pref), c))


def _class_rows(m_by_name: list[tuple[str, dict]]) -> list[list[str]]:
    rows = []
    for name, m in m_by_name:
        rows.append(
            [
                name,
                str(m.get("requests", 0)),
                _pct(m.get("attainment")),
                str(m.get("violations", 0)),
                _f(m.get("ttft_ms", {}).get("p50"), "{:.0f}"),
                _f(m.get("ttft_ms", {}).get("p99"), "{:.0f}"),
                _f(m.get("tpot_ms", {}).get("p50")),
                _f(m.get("tpot_ms", {}).get("p99")),
                _f(m.get("tpot_target_ms")) if name != "overall" else "",
                _f(m.get("goodput_tok_s")),
            ]
        )
    return rows


CLASS_HEADER = [
    "class",
    "reqs",
    "attain %",
    "viol",
    "TTFT p50",
    "TTFT p99",
    "TPOT p50",
    "TPOT p99",
    "TPOT tgt",
    "goodput tok/s",
]


def format_class_table(result: dict) -> str:
    """Terminal table: per policy, one row per class plus ``overall`` (ms, tok/s)."""
    if "points" in result:
        return _format_sweep_table(result)
    parts = []
    results = result.get("results", {})
    classes = _class_order([results])
    for pol, res in results.items():
        rows = [(c, res["per_class"][c]) for c in classes if c in res.get("per_class", {})]
        rows.append(("overall", res["overall"]))
        parts.append(f"policy {pol}:\n" + _text_table(CLASS_HEADER, _class_rows(rows)))
    return "\n\n".join(parts)


def _format_sweep_table(result: dict) -> str:
    pts = result.get("points", [])
    pols = []
    for p in pts:
        for k in p["results"]:
            if k not in pols:
                pols.append(k)
    xname = result.get("config", {}).get("sweep", "x")
    header = [xname] + [f"{p} attain%" for p in pols] + [f"{p} goodput" for p in pols]
    rows = []
    for p in pts:
        r = p["results"]
        rows.append(
            [_f(p["x"], "{:g}")]
            + [_pct(r[q]["overall"].get("attainment")) if q in r else "-" for q in pols]
            + [_f(r[q]["overall"].get("goodput_tok_s")) if q in r else "-" for q in pols]
        )
    return _text_table(header, rows)


def _sweep_policies(pts: list[dict]) -> list[str]:
    """Policy names over all sweep points, in first-seen order."""
    pols: list[str] = []
    for p in pts:
        for k in p["results"]:
            if k not in pols:
                pols.append(k)
    return pols
