"""The report's PNG plots (matplotlib, imported on first use).

serve: ``overview.png`` (attainment and goodput per policy and class),
``latency_cdf.png`` (per-class TPOT and TTFT CDFs), ``timeline.png`` (tree size and
the strict class's rolling attainment over time, shifts marked). sweep: ``sweep.png``
(attainment and goodput against x per policy) and ``sweep_per_class.png``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from adaserve.bench.tables import AZURE_ATTRIBUTION, _class_order, _sweep_policies, _uses_azure


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
                v: Any = [getattr(r, metric) for r in rs if r.cls == c and r.completed]
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


# the x axis of each sweep, with its unit
SWEEP_AXES = {
    "rate": "request rate (req/s)",
    "strict-share": "strict (interactive) share of requests",
    "slo-scale": "SLO scale (x every class's TPOT target)",
}


def sweep_axis_label(sweep: str) -> str:
    """The x-axis label of a sweep over ``sweep``, with its unit."""
    return SWEEP_AXES.get(sweep, sweep)


def _plot_sweep(out: Path, result: dict) -> list[Path]:
    plt = _plt()
    cfg = result.get("config", {})
    pts = result.get("points", [])
    xname = sweep_axis_label(cfg.get("sweep", "x"))
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
