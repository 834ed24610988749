"""Text formatting of benchmark results: numbers, Markdown and terminal tables.

The per-class terminal table (``format_class_table``, also the sweep's table with the
SLO capacity and oracle share), the helpers the Markdown summary and the plots share
(class order, sweep policies, capacity rows) and the trace attribution every output
carries when the Azure trace was used.

Two attainment columns everywhere: ``SLO ok %`` (completed, mean TPOT and TTFT within
their targets: ``attainment``) and ``TPOT ok %`` (TPOT target only, TTFT ignored:
``tpot_attainment``).

Repeated runs (``--repeat`` / ``--seeds``): ``rounds_lines`` gives each policy's mean
± half its 95% interval across runs (``overall.rounds``), ``comparison_lines`` the
first policy against each other one (``result["comparisons"]``), in the terminal and
in ``summary.md``.
"""

from __future__ import annotations

import math

from adaserve.bench.capacity import is_baseline, slo_capacity

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


def _text_table(header: list[str], rows: list[list[str]], left: int = 1) -> str:
    """Aligned columns: the first ``left`` flush left, the others right."""
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w[i]) if i < left else c.rjust(w[i]) for i, c in enumerate(cells)
        ).rstrip()

    out = [line(header), "  ".join("-" * x for x in w)]
    out += [line(r) for r in rows]
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
                _pct(m.get("tpot_attainment")),
                str(m.get("violations", 0)),
                _f(m.get("ttft_ms", {}).get("p50"), "{:.0f}"),
                _f(m.get("ttft_ms", {}).get("p99"), "{:.0f}"),
                _f(m.get("tpot_ms", {}).get("p50")),
                _f(m.get("tpot_ms", {}).get("p99")),
                _f(m.get("tpot_target_ms")) if name != "overall" else "",
                _f(m.get("goodput_tok_s")),
                _f(m.get("energy_per_token_j"), "{:.3g}"),
            ]
        )
    return rows


CLASS_HEADER = [
    "class",
    "reqs",
    "SLO ok %",
    "TPOT ok %",
    "viol",
    "TTFT p50",
    "TTFT p99",
    "TPOT p50",
    "TPOT p99",
    "TPOT tgt",
    "goodput tok/s",
    "J/token",
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
    """One row per point and policy: overall and per-class attainment (SLO / TPOT only),
    goodput and, with an oracle, its share of the oracle's; then the SLO capacity."""
    pts = result.get("points", [])
    pols = _sweep_policies(pts)
    classes = _class_order([p["results"] for p in pts])
    ref = result.get("goodput_reference")
    xname = result.get("config", {}).get("sweep", "x")
    header = [xname, "policy", "SLO ok %", "TPOT ok %"]
    header += [f"{c} SLO/TPOT ok %" for c in classes] + ["goodput tok/s"]
    if ref:
        header.append(f"% of {ref} goodput")
    rows = []
    for p in pts:
        for q in pols:
            r = p["results"].get(q)
            if r is None:
                continue
            o = r["overall"]
            row = [_f(p["x"], "{:g}"), q, _pct(o.get("attainment")), _pct(o.get("tpot_attainment"))]
            for c in classes:
                m = r.get("per_class", {}).get(c)
                row.append(
                    f"{_pct(m.get('attainment'))} / {_pct(m.get('tpot_attainment'))}" if m else "-"
                )
            row.append(_f(o.get("goodput_tok_s")))
            if ref:
                row.append(_pct((p.get("goodput_share") or {}).get(q)))
            rows.append(row)
    out = _text_table(header, rows, left=2)
    cap = sweep_capacity(result)
    if cap:
        out += "\n\n" + capacity_title(cap) + ":\n" + _text_table(*capacity_table(cap))
    return out


def sweep_capacity(result: dict) -> dict | None:
    """The sweep's ``capacity`` (computed from its points when an older result lacks it);
    None for sweeps that are not over the request rate."""
    if result.get("config", {}).get("sweep") != "rate" or not result.get("points"):
        return None
    return result.get("capacity") or slo_capacity(result["points"])


def capacity_title(cap: dict) -> str:
    """One line saying what the capacity table shows."""
    pct = f"{100 * cap['threshold']:g}%"
    strict = cap.get("strict_class")
    of_strict = f" and >= {pct} of {strict} (strictest TPOT target)" if strict else ""
    return (
        f"SLO capacity (req/s): highest swept rate with >= {pct} of all requests"
        f"{of_strict} within their SLO"
    )


def _capacity_cell(d: dict) -> str:
    cap = d["capacity_rps"]
    if cap is None:
        return f"< {d['lowest_rate']:g}"
    return f"≥ {cap:g}" if d["at_highest"] else f"{cap:g}"


def _ratio_cell(d: dict) -> str:
    r = d.get("ratio_to_best_baseline")
    if r is None:
        return "-"
    sign = {"at_least": "≥ ", "at_most": "≤ "}.get(d.get("ratio_bound") or "", "")
    return f"{sign}{r:.2f}x"


def capacity_table(cap: dict) -> tuple[list[str], list[list[str]]]:
    """(header, rows) of the capacity table: one row per policy, the ratio to the best
    baseline shown for ``adaserve`` variants."""
    best = cap.get("best_baseline")
    header = ["policy", "capacity req/s", "rates meeting both", f"vs best baseline ({best or '-'})"]
    rows = []
    for pol, d in cap["policies"].items():
        ratio = "" if is_baseline(pol) or pol.startswith("oracle") else _ratio_cell(d)
        if pol == best:
            ratio = "(best baseline)"
        rates = ", ".join(f"{x:g}" for x in d["qualifying_rates"]) or "none"
        rows.append([pol, _capacity_cell(d), rates, ratio])
    return header, rows


def _sweep_policies(pts: list[dict]) -> list[str]:
    """Policy names over all sweep points, in first-seen order."""
    pols: list[str] = []
    for p in pts:
        for k in p["results"]:
            if k not in pols:
                pols.append(k)
    return pols


# ---------------------------------------------------------------------- across runs
# (label, scale, unit) of the figures ``overall.rounds`` and ``comparisons`` carry
ROUND_LABELS = {
    "attainment": ("SLO ok", 100.0, "%"),
    "tpot_attainment": ("TPOT ok", 100.0, "%"),
    "goodput_tok_s": ("goodput", 1.0, "tok/s"),
}
# the comparison's names: attainment differences are in percentage points
PAIR_LABELS = {
    "attainment": ("attainment", 100.0, "points"),
    "tpot_attainment": ("TPOT attainment", 100.0, "points"),
    "goodput_tok_s": ("goodput", 1.0, "tok/s"),
}


def format_stat(stat: dict | None, scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    """``mean ± half-width`` of a ``rounds.mean_ci`` dict (x ``scale``); ``mean (one
    run: no interval)`` without an interval, ``-`` without a mean."""
    if not stat or stat.get("mean") is None:
        return "-"
    mean = fmt.format(scale * stat["mean"])
    ci = stat.get("ci95")
    if ci is None:
        return f"{mean} (one run: no interval)"
    return f"{mean} ± {fmt.format(scale * (ci[1] - ci[0]) / 2)}"


def rounds_lines(results: dict) -> list[str]:
    """One line per policy with ``overall.rounds``: SLO ok, TPOT ok and goodput as
    mean ± half the 95% interval across runs, then each class's SLO attainment."""
    lines = []
    for pol, r in results.items():
        rd = r.get("overall", {}).get("rounds")
        if not rd:
            continue
        figs = ", ".join(
            f"{label} {format_stat(rd.get(k), scale)} {unit}"
            for k, (label, scale, unit) in ROUND_LABELS.items()
            if k in rd
        )
        lines.append(f"  {pol}: {figs} ({rd.get('n', '?')} runs)")
        per = rd.get("per_class_attainment") or {}
        if per:
            order = _class_order([{pol: {"per_class": per}}])
            cls = ", ".join(f"{c} {format_stat(per[c], 100.0)} %" for c in order)
            lines.append(f"      SLO ok per class: {cls}")
    return lines


def _signed(v: float) -> str:
    return f"{v:+.1f}"


def pair_verdict(cmp: dict) -> str:
    """Both verdicts of one figure's ``rounds.compare`` dict, in words: "separated
    (paired); intervals overlap: not separated"."""
    p = cmp["paired"]
    if p.get("ci95") is None:
        return "not separated (fewer than two runs: no interval)"
    paired = "separated" if p["separated"] else "not separated"
    iv = "apart: separated" if cmp["intervals"]["separated"] else "overlap: not separated"
    return f"{paired} (paired); intervals {iv}"


def format_difference(cmp: dict, key: str) -> str:
    """``+12.3 points [+4.1, +20.5]`` (the paired difference and its 95% interval)."""
    _, scale, unit = PAIR_LABELS.get(key, (key, 1.0, ""))
    p = cmp["paired"]
    if p.get("mean_diff") is None:
        return "-"
    out = f"{_signed(scale * p['mean_diff'])} {unit}"
    ci = p.get("ci95")
    if ci is not None:
        out += f" [{_signed(scale * ci[0])}, {_signed(scale * ci[1])}]"
    return out


def comparison_lines(comparisons: dict | None, keys=("attainment", "goodput_tok_s")) -> list[str]:
    """One line per other policy and figure of ``keys``: "adaserve vs ar: attainment
    +12.3 points [+4.1, +20.5], separated (paired); intervals overlap: not separated"."""
    if not comparisons:
        return []
    ref = comparisons["reference"]
    lines = []
    for pol, figs in comparisons.get("against", {}).items():
        for k in keys:
            cmp = figs.get(k)
            if cmp is None:
                continue
            label = PAIR_LABELS.get(k, (k,))[0]
            lines.append(
                f"  {ref} vs {pol}: {label} {format_difference(cmp, k)}, {pair_verdict(cmp)}"
            )
    return lines
