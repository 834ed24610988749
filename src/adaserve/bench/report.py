"""Write benchmark results: ``result.json``, ``summary.md`` (Markdown tables) and PNG plots.

Files written to ``out_dir``:

- ``result.json``: the result dict (serve: ``{"config", "results": {POLICY: {"overall",
  "per_class"}}}``; sweep: ``{"config", "points": [{"x", "results"}]}``).
- ``summary.md``: overall and per-class tables (sweep: one row per point).
- ``requests.jsonl`` (when records are given): one line per request and policy.
- ``timeline.json`` (when timelines are given): per-iteration samples per policy.
- PNGs. serve: ``overview.png`` (attainment and goodput per policy and class),
  ``latency_cdf.png`` (per-class TPOT and TTFT CDFs), ``timeline.png`` (tree size and
  the strict class's rolling attainment over time, shifts marked). sweep:
  ``sweep.png`` (attainment and goodput against x per policy) and
  ``sweep_per_class.png``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

AZURE_ATTRIBUTION = (
    "Arrivals: Azure LLM inference trace 2023 (CC-BY 4.0), Patel et al., "
    '"Splitwise", ISCA 2024; github.com/Azure/AzurePublicDataset'
)


def _dumps(x, **kw) -> str:
    """JSON of x, cleaned (``_clean``) only when it needs it: the walk over every
    value costs seconds for an hour of simulated requests."""
    try:
        return json.dumps(x, allow_nan=False, **kw)
    except (TypeError, ValueError):  # numpy values, NaN or inf
        return json.dumps(_clean(x), **kw)


def _clean(x):
    """JSON-safe copy: NaN/inf -> None, numpy scalars -> Python."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, (np.floating, float)):
        v = float(x)
        return v if math.isfinite(v) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


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


# ---------------------------------------------------------------------- summary.md
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
    "attain %",
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
        first = next((r["per_class"][c] for r in results.values() if c in r["per_class"]), {})
        tgt = (
            f"TPOT target {_f(first.get('tpot_target_ms'))} ms, "
            f"TTFT target {_f(first.get('ttft_target_ms'), '{:.0f}')} ms"
        )
        header = [
            "policy",
            "reqs",
            "attain %",
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


def serve_summary_md(result: dict) -> str:
    cfg = result.get("config", {})
    results = result.get("results", {})
    parts = [
        "# adaserve bench serve",
        "## Configuration\n\n" + _config_md(cfg),
        "## Overall\n\nLatencies in ms. Attainment: mean TPOT and TTFT within the class "
        "targets; goodput counts output tokens of requests that attained their SLO.\n\n"
        + _md_table(OVERALL_HEADER, [_overall_row(p, r["overall"]) for p, r in results.items()]),
        "## Per class\n\n" + _per_class_md(results),
    ]
    sh = _shifts_md(results)
    if sh:
        parts.append(
            "## Shifts\n\nStrict class's attainment before/after each shift and the time "
            "until its rolling attainment stays within 5 points of the new steady state.\n\n" + sh
        )
    if _uses_azure(cfg):
        parts.append(f"---\n{AZURE_ATTRIBUTION}")
    return "\n\n".join(parts) + "\n"


def _sweep_policies(pts: list[dict]) -> list[str]:
    """Policy names over all sweep points, in first-seen order."""
    pols: list[str] = []
    for p in pts:
        for k in p["results"]:
            if k not in pols:
                pols.append(k)
    return pols


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
        "## Overall",
        table("SLO attainment (%)", lambda r: _pct(r["overall"]["attainment"])),
        table("SLO violations", lambda r: str(r["overall"]["violations"])),
        table("Goodput (tok/s)", lambda r: _f(r["overall"]["goodput_tok_s"])),
        table("Throughput (tok/s)", lambda r: _f(r["overall"]["throughput_tok_s"])),
        table("TPOT p99 (ms)", lambda r: _f(r["overall"]["tpot_ms"]["p99"])),
        "## Per class attainment (%)",
    ]
    for c in classes:
        parts.append(
            table(
                c,
                lambda r, c=c: (
                    _pct(r["per_class"][c]["attainment"]) if c in r["per_class"] else "-"
                ),
            )
        )
    if _uses_azure(cfg):
        parts.append(f"---\n{AZURE_ATTRIBUTION}")
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------- plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _footer(fig, config: dict) -> None:
    if _uses_azure(config):
        fig.text(0.01, 0.005, AZURE_ATTRIBUTION, fontsize=6, color="0.4")


def _plot_overview(out: Path, result: dict) -> Path:
    plt = _plt()
    results = result["results"]
    pols = list(results)
    classes = _class_order([results])
    groups = ["overall"] + classes
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(pols))
    x = np.arange(len(groups))
    for j, p in enumerate(pols):
        att, gp = [], []
        for g in groups:
            m = results[p]["overall"] if g == "overall" else results[p]["per_class"].get(g)
            att.append(100 * (m.get("attainment") or 0.0) if m else 0.0)
            gp.append((m.get("goodput_tok_s") or 0.0) if m else 0.0)
        axes[0].bar(x + j * width, att, width, label=p)
        axes[1].bar(x + j * width, gp, width, label=p)
    for ax, title in zip(axes, ("SLO attainment (%)", "goodput (tok/s)")):
        ax.set_xticks(x + width * (len(pols) - 1) / 2, groups)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylim(0, 105)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    _footer(fig, result.get("config", {}))
    path = out / "overview.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_cdfs(out: Path, result: dict, records: dict) -> Path | None:
    from adaserve.bench.metrics import RequestRecord

    plt = _plt()
    recs = {
        p: [r if isinstance(r, RequestRecord) else RequestRecord.from_dict(r) for r in rs]
        for p, rs in records.items()
    }
    classes = _class_order([result["results"]]) or sorted(
        {r.cls for rs in recs.values() for r in rs}
    )
    if not classes:
        return None
    fig, axes = plt.subplots(2, len(classes), figsize=(4 * len(classes), 6.5), squeeze=False)
    for j, c in enumerate(classes):
        for i, (metric, label) in enumerate((("tpot_ms", "TPOT (ms)"), ("ttft_ms", "TTFT (ms)"))):
            ax = axes[i][j]
            target = None
            for p, rs in recs.items():
                v = [getattr(r, metric) for r in rs if r.cls == c and r.completed]
                v = np.sort(np.asarray([x for x in v if x is not None], dtype=float))
                if v.size:
                    ax.plot(v, np.arange(1, v.size + 1) / v.size, label=p, drawstyle="steps-post")
                tg = [getattr(r, metric.replace("_ms", "_target_ms")) for r in rs if r.cls == c]
                tg = [t for t in tg if t is not None]
                target = target or (float(np.median(tg)) if tg else None)
            if target:
                ax.axvline(target, color="k", ls="--", lw=0.8, label="target")
            ax.set_title(f"{c}: {label}", fontsize=9)
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            if i == 1:
                ax.set_xlabel(label)
            if j == 0:
                ax.set_ylabel("CDF")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    _footer(fig, result.get("config", {}))
    path = out / "latency_cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _smooth(t: np.ndarray, v: np.ndarray, window_s: float) -> tuple[np.ndarray, np.ndarray]:
    if t.size == 0:
        return t, v
    edges = np.arange(0.0, float(t.max()) + window_s, window_s)
    idx = np.digitize(t, edges)
    ts, vs = [], []
    for k in np.unique(idx):
        sel = idx == k
        ts.append(float(t[sel].mean()))
        vs.append(float(v[sel].mean()))
    return np.asarray(ts), np.asarray(vs)


def _plot_timeline(out: Path, result: dict, timelines: dict, records: dict | None) -> Path | None:
    from adaserve.bench.metrics import RequestRecord, rolling_attainment

    plt = _plt()
    cfg = result.get("config", {})
    strict = cfg.get("strict_class")
    window = float(cfg.get("convergence_window_s") or 5.0)
    n_rows = 3 if records else 2
    fig, axes = plt.subplots(n_rows, 1, figsize=(10, 2.6 * n_rows), sharex=True)
    bin_s = max(0.25, window / 5)
    for p, samples in timelines.items():
        if not samples:
            continue
        t = np.asarray([s["t"] for s in samples], dtype=float)
        if strict:
            tree = np.asarray(
                [s.get("tree_by_class", {}).get(strict, np.nan) for s in samples], dtype=float
            )
            ok = np.isfinite(tree)
            ts, vs = _smooth(t[ok], tree[ok], bin_s)
        else:
            ts, vs = _smooth(t, np.asarray([s["tree_mean"] for s in samples], float), bin_s)
        axes[0].plot(ts, vs, label=p)
        kt, kv = _smooth(t, 100 * np.asarray([s["kv_usage"] for s in samples], float), bin_s)
        axes[1].plot(kt, kv, label=p)
    axes[0].set_ylabel(f"tree nodes / req\n({strict or 'all'})", fontsize=8)
    axes[1].set_ylabel("KV use (%)", fontsize=8)
    if records:
        for p, rs in records.items():
            rs = [r if isinstance(r, RequestRecord) else RequestRecord.from_dict(r) for r in rs]
            t_end = max((r.finish_s or r.arrival_s for r in rs), default=0.0)
            tt, vv = rolling_attainment(rs, strict, window, t_end)
            axes[2].plot(tt, 100 * vv, label=p)
        axes[2].set_ylabel(f"rolling attainment %\n({strict or 'all'}, {window:g} s)", fontsize=8)
        axes[2].set_ylim(-2, 102)
    for s in cfg.get("shifts") or []:
        try:
            at = float(str(s).split(":", 1)[0])
        except ValueError:
            continue
        for ax in axes:
            ax.axvline(at, color="k", ls="--", lw=0.8)
        axes[0].annotate(
            str(s).split(":", 1)[1],
            (at, 1.0),
            xycoords=("data", "axes fraction"),
            fontsize=7,
            va="top",
        )
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="upper right")
    axes[-1].set_xlabel("time (s)")
    fig.tight_layout()
    _footer(fig, cfg)
    path = out / "timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_sweep(out: Path, result: dict) -> list[Path]:
    plt = _plt()
    cfg = result.get("config", {})
    pts = result.get("points", [])
    xname = cfg.get("sweep", "x")
    pols = _sweep_policies(pts)
    xs = [p["x"] for p in pts]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for q in pols:
        att = [
            100 * (p["results"][q]["overall"]["attainment"] or 0) if q in p["results"] else np.nan
            for p in pts
        ]
        gp = [
            (p["results"][q]["overall"]["goodput_tok_s"] or 0) if q in p["results"] else np.nan
            for p in pts
        ]
        axes[0].plot(xs, att, marker="o", label=q)
        axes[1].plot(xs, gp, marker="o", label=q)
    axes[0].set_ylabel("SLO attainment (%)")
    axes[0].set_ylim(-2, 102)
    axes[1].set_ylabel("goodput (tok/s)")
    for ax in axes:
        ax.set_xlabel(xname)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    _footer(fig, cfg)
    paths = [out / "sweep.png"]
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    classes = _class_order([p["results"] for p in pts])
    if classes:
        fig, axes = plt.subplots(1, len(classes), figsize=(4 * len(classes), 3.6), squeeze=False)
        for j, c in enumerate(classes):
            ax = axes[0][j]
            for q in pols:
                ys = []
                for p in pts:
                    m = p["results"].get(q, {}).get("per_class", {}).get(c)
                    ys.append(100 * (m["attainment"] or 0) if m else np.nan)
                ax.plot(xs, ys, marker="o", label=q)
            ax.set_title(f"{c}: attainment (%)", fontsize=9)
            ax.set_xlabel(xname)
            ax.set_ylim(-2, 102)
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        _footer(fig, cfg)
        paths.append(out / "sweep_per_class.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


# ---------------------------------------------------------------------- entry point
def write_report(
    out_dir,
    result: dict,
    kind: str = "serve",
    timelines: dict | None = None,
    records: dict | None = None,
    plots: bool = True,
) -> list[Path]:
    """Write ``result.json``, ``summary.md`` and the PNGs to ``out_dir``; returns paths.

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
