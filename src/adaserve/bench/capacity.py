"""SLO capacity of a rate sweep and goodput as a share of an oracle's.

**SLO capacity** (DistServe's definition): the highest swept request rate at which at
least 90% of all requests *and* at least 90% of the strictest class's requests attain
their SLO (TPOT and TTFT, ``RequestRecord.attained``). The strictest class is the one
with the smallest TPOT target (``strictest_class``, the one place that defines it). A
point where the strictest class sent no request does not qualify (nothing shows it
attained). Capacity is None when no swept rate qualifies (it is below the lowest rate)
and flagged ``at_highest`` when the highest swept rate qualifies (it is at least that).

The **best baseline** is the policy with the highest capacity among those that are
neither ``adaserve*`` nor ``oracle*``; each policy gets its capacity's ratio to it.

**Oracle share**: when a sweep holds a policy whose name starts with ``oracle``, each
policy's goodput at each point as a share of that policy's goodput there.

Everything here reads the sweep's result dict (``{"config", "points": [{"x",
"results": {POLICY: {"overall", "per_class"}}}]}``); ``annotate_sweep`` adds the keys
``capacity`` (rate sweeps), ``goodput_reference`` and per point ``goodput_share``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

CAPACITY_ATTAINMENT = 0.9
CHALLENGER_PREFIXES = ("adaserve", "oracle")


def strictest_class(tpot_targets: Mapping[str, float | None]) -> str | None:
    """The class with the smallest TPOT target (ties: first by name); None when no class
    has a target."""
    have = [(t, c) for c, t in tpot_targets.items() if t is not None]
    return min(have)[1] if have else None


def sweep_tpot_targets(points: Iterable[dict]) -> dict[str, float]:
    """{class: its smallest mean TPOT target over every point and policy of a sweep}."""
    out: dict[str, float] = {}
    for p in points:
        for res in p["results"].values():
            for c, m in res.get("per_class", {}).items():
                t = m.get("tpot_target_ms")
                if t is not None:
                    out[c] = min(t, out.get(c, t))
    return out


def meets_slo(summary: dict, strict: str | None, threshold: float = CAPACITY_ATTAINMENT) -> bool:
    """Whether one run (``{"overall", "per_class"}``) has overall attainment and the
    ``strict`` class's attainment both at least ``threshold`` (no strict class: overall
    only)."""
    overall = summary.get("overall", {}).get("attainment")
    if overall is None or overall < threshold:
        return False
    if strict is None:
        return True
    m = summary.get("per_class", {}).get(strict)
    att = m.get("attainment") if m else None
    return att is not None and att >= threshold


def is_baseline(policy: str) -> bool:
    """A policy that is neither an ``adaserve`` variant nor an ``oracle``."""
    return not policy.startswith(CHALLENGER_PREFIXES)


def slo_capacity(
    points: list[dict], strict: str | None = None, threshold: float = CAPACITY_ATTAINMENT
) -> dict:
    """Each policy's SLO capacity over a rate sweep's ``points`` (``x`` = requests/s).

    Returns ``{"threshold", "strict_class", "best_baseline", "best_baseline_rps",
    "policies": {POLICY: {"capacity_rps", "qualifying_rates", "lowest_rate",
    "highest_rate", "at_highest", "ratio_to_best_baseline", "ratio_bound"}}}``.
    ``strict`` defaults to ``strictest_class`` of the sweep's targets. The ratio is
    None when either capacity is None or both are at their highest rate;
    ``ratio_bound`` is ``exact``, ``at_least`` (the policy's capacity is at its highest
    rate) or ``at_most`` (the best baseline's is).
    """
    if strict is None:
        strict = strictest_class(sweep_tpot_targets(points))
    pols: dict[str, dict] = {}
    for p in sorted(points, key=lambda p: p["x"]):
        for pol, res in p["results"].items():
            d = pols.setdefault(pol, {"rates": [], "qualifying_rates": []})
            d["rates"].append(p["x"])
            if meets_slo(res, strict, threshold):
                d["qualifying_rates"].append(p["x"])
    out: dict[str, dict] = {}
    for pol, d in pols.items():
        cap = max(d["qualifying_rates"]) if d["qualifying_rates"] else None
        out[pol] = {
            "capacity_rps": cap,
            "qualifying_rates": d["qualifying_rates"],
            "lowest_rate": min(d["rates"]),
            "highest_rate": max(d["rates"]),
            "at_highest": cap is not None and cap == max(d["rates"]),
        }
    baselines = [(d["capacity_rps"], pol) for pol, d in out.items() if is_baseline(pol)]
    rated = [(c, pol) for c, pol in baselines if c is not None]
    best = max(rated, key=lambda t: t[0])[1] if rated else None
    best_rps = out[best]["capacity_rps"] if best else None
    for d in out.values():
        d["ratio_to_best_baseline"], d["ratio_bound"] = _ratio(d, out[best] if best else None)
    return {
        "threshold": threshold,
        "strict_class": strict,
        "best_baseline": best,
        "best_baseline_rps": best_rps,
        "policies": out,
    }


def _ratio(d: dict, best: dict | None) -> tuple[float | None, str | None]:
    if best is None or d["capacity_rps"] is None or not best["capacity_rps"]:
        return None, None
    if d["at_highest"] and best["at_highest"]:
        return None, None  # both only bounded below: no ratio
    bound = "at_least" if d["at_highest"] else "at_most" if best["at_highest"] else "exact"
    return d["capacity_rps"] / best["capacity_rps"], bound


def oracle_policy(policies: Iterable[str]) -> str | None:
    """The first policy whose name starts with ``oracle`` (None if none)."""
    return next((p for p in policies if p.startswith("oracle")), None)


def goodput_shares(results: Mapping[str, dict], reference: str) -> dict[str, float | None]:
    """{policy: its overall goodput / ``reference``'s} at one point (None where the
    reference did not run or had no goodput)."""
    ref = results.get(reference)
    g = ref["overall"].get("goodput_tok_s") if ref else None
    out: dict[str, float | None] = {}
    for pol, res in results.items():
        mine = res["overall"].get("goodput_tok_s")
        out[pol] = mine / g if g and mine is not None else None
    return out


def annotate_sweep(result: dict, reference: str | None = None) -> dict:
    """Add ``capacity`` (rate sweeps) and, with an oracle (or ``reference``) among the
    policies, ``goodput_reference`` and each point's ``goodput_share``; returns
    ``result``."""
    pts = result.get("points", [])
    if result.get("config", {}).get("sweep") == "rate" and pts:
        result["capacity"] = slo_capacity(pts)
    pols = list(dict.fromkeys(p for pt in pts for p in pt["results"]))
    ref = reference or oracle_policy(pols)
    if ref is not None and ref in pols:
        result["goodput_reference"] = ref
        for pt in pts:
            pt["goodput_share"] = goodput_shares(pt["results"], ref)
    return result
