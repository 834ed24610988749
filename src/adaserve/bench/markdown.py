"""``summary.md``: the configuration, overall and per-class tables, shifts and, with
repeated runs, the figures across runs and the comparisons (serve) or one row per
point, the SLO capacity and the oracle share (sweep), in Markdown."""

from __future__ import annotations

from typing import Any

from adaserve.bench.tables import (
    AZURE_ATTRIBUTION,
    PAIR_LABELS,
    ROUND_LABELS,
    _class_order,
    _f,
    _md_table,
    _pct,
    _sweep_policies,
    _uses_azure,
    capacity_table,
    capacity_title,
    format_difference,
    format_stat,
    sweep_capacity,
)


def _config_md(config: dict) -> str:
    lines = []
    for k, v in config.items():
        if isinstance(v, dict):
            v = ", ".join(f"{a}={b}" for a, b in v.items())
        elif isinstance(v, list):
            v = "; ".join(str(x) for x in v) or "-"
        lines.append(f"- **{k}**: {v}")
    return "\n".join(lines)


OVERALL_HEADER = [
    "policy",
    "reqs",
    "SLO ok %",
    "TPOT ok %",
    "viol",
    "tok/s",
    "goodput tok/s",
    "req goodput/s",
    "TTFT p50",
    "TTFT p99",
    "TPOT mean",
    "TPOT p50",
    "TPOT p95",
    "TPOT p99",
    "ITL p99",
    "E2E p99",
    "accept %",
    "rej. FLOPs %",
    "mJ/token",
    "peak KV %",
    "fallback it.",
    "shed",
]


def _overall_row(pol: str, m: dict) -> list[str]:
    en = m.get("energy") or {}
    return [
        pol,
        str(m.get("requests", 0)),
        _pct(m.get("attainment")),
        _pct(m.get("tpot_attainment")),
        str(m.get("violations", 0)),
        _f(m.get("throughput_tok_s")),
        _f(m.get("goodput_tok_s")),
        _f(m.get("request_goodput_rps"), "{:.2f}"),
        _f(m["ttft_ms"].get("p50"), "{:.0f}"),
        _f(m["ttft_ms"].get("p99"), "{:.0f}"),
        _f(m["tpot_ms"].get("mean")),
        _f(m["tpot_ms"].get("p50")),
        _f(m["tpot_ms"].get("p95")),
        _f(m["tpot_ms"].get("p99")),
        _f(m["itl_ms"].get("p99")),
        _f(m["e2e_ms"].get("p99"), "{:.0f}"),
        _pct(m.get("acceptance_rate")),
        _pct(m.get("rejected_flops_share")),
        _f(en.get("energy_per_token_mj"), "{:.3g}"),
        _pct(m.get("peak_kv_usage")),
        str(m.get("fallback_iterations_total", "-")),
        str(m.get("shed", 0)),
    ]


def _per_class_md(results: dict) -> str:
    out = []
    for c in _class_order([results]):
        first: dict[str, Any] = next(
            (r["per_class"][c] for r in results.values() if c in r["per_class"]), {}
        )
        tgt = (
            f"TPOT target {_f(first.get('tpot_target_ms'))} ms, "
            f"TTFT target {_f(first.get('ttft_target_ms'), '{:.0f}')} ms"
        )
        header = [
            "policy",
            "reqs",
            "SLO ok %",
            "TPOT ok %",
            "viol",
            "goodput tok/s",
            "TTFT p50",
            "TTFT p95",
            "TTFT p99",
            "TPOT mean",
            "TPOT p50",
            "TPOT p95",
            "TPOT p99",
            "ITL p50",
            "ITL p99",
            "E2E p50",
            "E2E p99",
            "accept %",
            "J/token",
        ]
        rows = []
        for pol, r in results.items():
            m = r["per_class"].get(c)
            if m is None:
                continue
            rows.append(
                [
                    pol,
                    str(m["requests"]),
                    _pct(m["attainment"]),
                    _pct(m.get("tpot_attainment")),
                    str(m["violations"]),
                    _f(m["goodput_tok_s"]),
                    _f(m["ttft_ms"]["p50"], "{:.0f}"),
                    _f(m["ttft_ms"]["p95"], "{:.0f}"),
                    _f(m["ttft_ms"]["p99"], "{:.0f}"),
                    _f(m["tpot_ms"]["mean"]),
                    _f(m["tpot_ms"]["p50"]),
                    _f(m["tpot_ms"]["p95"]),
                    _f(m["tpot_ms"]["p99"]),
                    _f(m["itl_ms"]["p50"]),
                    _f(m["itl_ms"]["p99"]),
                    _f(m["e2e_ms"]["p50"], "{:.0f}"),
                    _f(m["e2e_ms"]["p99"], "{:.0f}"),
                    _pct(m.get("acceptance_rate")),
                    _f(m.get("energy_per_token_j"), "{:.3g}"),
                ]
            )
        out.append(f"### {c} ({tgt})\n\n" + _md_table(header, rows))
    return "\n\n".join(out)


def _shifts_md(results: dict) -> str | None:
    rows = []
    for pol, r in results.items():
        for s in r["overall"].get("shifts") or []:
            rows.append(
                [
                    pol,
                    _f(s.get("at_s"), "{:g}"),
                    str(s.get("change", "")),
                    _pct(s.get("pre_steady")),
                    _pct(s.get("post_steady")),
                    _pct(s.get("dip")),
                    _f(s.get("convergence_s"), "{:.1f}", "not converged"),
                ]
            )
    if not rows:
        return None
    header = [
        "policy",
        "at s",
        "change",
        "before %",
        "steady after %",
        "lowest %",
        "convergence s",
    ]
    return _md_table(header, rows)


def _rounds_md(result: dict) -> str | None:
    """The figures across runs (``overall.rounds``: mean ± half the 95% interval) and
    the first policy against each other one (``result["comparisons"]``); None without
    repeated runs."""
    results = result.get("results", {})
    have = {p: r["overall"]["rounds"] for p, r in results.items() if r["overall"].get("rounds")}
    if not have:
        return None
    classes = _class_order([results])
    header = ["policy", "runs"] + [f"{label} {unit}" for label, _, unit in ROUND_LABELS.values()]
    header += [f"{c} SLO ok %" for c in classes]
    rows = []
    for pol, rd in have.items():
        per = rd.get("per_class_attainment") or {}
        rows.append(
            [pol, str(rd.get("n", "-"))]
            + [format_stat(rd.get(k), scale) for k, (_, scale, _) in ROUND_LABELS.items()]
            + [format_stat(per.get(c), 100.0) for c in classes]
        )
    out = (
        "Mean ± half the 95% interval (Student t, n - 1 degrees of freedom) across the "
        "runs (rounds x seeds), each run weighted alike; the tables above pool all "
        "requests.\n\n" + _md_table(header, rows)
    )
    cmp = result.get("comparisons")
    if cmp and cmp.get("against"):
        rows = []
        for pol, figs in cmp["against"].items():
            for k, c in figs.items():
                p = c["paired"]
                no_ci = p.get("ci95") is None
                rows.append(
                    [
                        pol,
                        PAIR_LABELS.get(k, (k,))[0],
                        format_difference(c, k),
                        "no interval"
                        if no_ci
                        else ("separated" if p["separated"] else "not separated"),
                        "-"
                        if no_ci
                        else ("separated" if c["intervals"]["separated"] else "not separated"),
                    ]
                )
        ref = cmp["reference"]
        out += (
            f"\n\n### {ref} against each policy\n\nPaired: the mean difference {ref} - "
            "policy over the runs of the same round and seed, its 95% interval, separated "
            "when that excludes 0. Intervals: separated only when the two policies' 95% "
            "intervals do not overlap (usually the stricter test).\n\n"
            + _md_table(["policy", "figure", f"{ref} - policy [95%]", "paired", "intervals"], rows)
        )
    return out


ATTAINMENT_NOTE = (
    "SLO ok %: requests that completed with mean TPOT and TTFT within their class's "
    "targets (`attainment`); TPOT ok %: completed with mean TPOT within target, TTFT "
    "ignored (`tpot_attainment`). Goodput counts output tokens of requests that attained "
    "their SLO (TPOT and TTFT)."
)


def serve_summary_md(result: dict) -> str:
    cfg = result.get("config", {})
    results = result.get("results", {})
    parts = [
        "# adaserve bench serve",
        "## Configuration\n\n" + _config_md(cfg),
        "## Overall\n\nLatencies in ms. "
        + ATTAINMENT_NOTE
        + "\n\n"
        + _md_table(OVERALL_HEADER, [_overall_row(p, r["overall"]) for p, r in results.items()]),
        "## Per class\n\n" + _per_class_md(results),
    ]
    rd = _rounds_md(result)
    if rd:
        parts.append("## Across runs\n\n" + rd)
    sh = _shifts_md(results)
    if sh:
        parts.append(
            "## Shifts\n\nStrict class's attainment before/after each shift and the time "
            "until its rolling attainment stays within 5 points of the new steady state.\n\n" + sh
        )
    if _uses_azure(cfg):
        parts.append(f"---\n{AZURE_ATTRIBUTION}")
    return "\n\n".join(parts) + "\n"


def sweep_summary_md(result: dict) -> str:
    cfg = result.get("config", {})
    pts = result.get("points", [])
    xname = cfg.get("sweep", "x")
    pols = _sweep_policies(pts)
    classes = _class_order([p["results"] for p in pts])

    def table(title: str, get) -> str:
        rows = []
        for p in pts:
            rows.append(
                [_f(p["x"], "{:g}")]
                + [get(p["results"][q]) if q in p["results"] else "-" for q in pols]
            )
        return f"### {title}\n\n" + _md_table([xname] + pols, rows)

    parts = [
        f"# adaserve bench sweep ({xname})",
        "## Configuration\n\n" + _config_md(cfg),
        "## Overall\n\n" + ATTAINMENT_NOTE,
        table(
            "SLO attainment: TPOT and TTFT (SLO ok %)",
            lambda r: _pct(r["overall"].get("attainment")),
        ),
        table(
            "TPOT-only attainment (TPOT ok %)",
            lambda r: _pct(r["overall"].get("tpot_attainment")),
        ),
        table("SLO violations", lambda r: str(r["overall"].get("violations", "-"))),
        table("Goodput (tok/s)", lambda r: _f(r["overall"].get("goodput_tok_s"))),
        table("Throughput (tok/s)", lambda r: _f(r["overall"].get("throughput_tok_s"))),
        table("TPOT p99 (ms)", lambda r: _f((r["overall"].get("tpot_ms") or {}).get("p99"))),
    ]
    ref = result.get("goodput_reference")
    if ref:
        rows = []
        for p in pts:
            share = p.get("goodput_share") or {}
            rows.append([_f(p["x"], "{:g}")] + [_pct(share.get(q)) for q in pols])
        parts.append(f"### Goodput as a share of {ref}'s (%)\n\n" + _md_table([xname] + pols, rows))
    cap = sweep_capacity(result)
    if cap:
        header, rows = capacity_table(cap)
        parts.append(
            "## SLO capacity\n\n"
            + capacity_title(cap)
            + " (DistServe's definition; ≥: the highest swept rate qualifies, <: none "
            "does). The ratio compares each adaserve variant with the best baseline "
            "(the highest capacity among the other policies, oracles excluded).\n\n"
            + _md_table(header, rows)
        )
    parts.append("## Per class attainment: SLO ok % / TPOT ok %")

    def both(m: dict) -> str:
        return f"{_pct(m.get('attainment'))} / {_pct(m.get('tpot_attainment'))}"

    for c in classes:
        parts.append(
            table(
                c,
                lambda r, c=c: both(r["per_class"][c]) if c in r["per_class"] else "-",
            )
        )
    if _uses_azure(cfg):
        parts.append(f"---\n{AZURE_ATTRIBUTION}")
    return "\n\n".join(parts) + "\n"
