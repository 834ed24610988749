"""Repeated runs (``--repeat``, ``--seeds``) of each policy: pooled into one summary,
their spread across runs, and the first policy against each other one."""

from __future__ import annotations

from adaserve.bench.metrics import summarize
from adaserve.bench.rounds import compare, mean_ci
from adaserve.bench.tables import comparison_lines, rounds_lines

# figures compared across runs (``overall.rounds``, ``comparisons``)
ROUND_FIGURES = ("attainment", "tpot_attainment", "goodput_tok_s")


def run_keys(runs: list[tuple[dict, list, int]]) -> list[dict]:
    """{"round", "seed"} of each run (``_serve_once``'s order: round by round, each
    round every seed once): the round is 1 + the earlier runs on the same seed."""
    seen: dict[int, int] = {}
    keys = []
    for _, _, seed in runs:
        seen[seed] = seen.get(seed, 0) + 1
        keys.append({"round": seen[seed], "seed": seed})
    return keys


def rounds_summary(runs: list[tuple[dict, list, int]]) -> dict:
    """``overall.rounds`` of one policy's runs: the mean and 95% interval across runs
    (``rounds.mean_ci``: ``{"mean", "ci95", "n"}``) of each of ``ROUND_FIGURES`` and
    of each class's attainment and TPOT attainment, with the runs' round and seed."""
    sums = [s for s, _, _ in runs]
    classes = sorted({c for s in sums for c in s["per_class"]})
    out: dict = {"n": len(sums), "runs": run_keys(runs)}
    for k in ROUND_FIGURES:
        out[k] = mean_ci([s["overall"].get(k) for s in sums])
    for k in ("attainment", "tpot_attainment"):
        out[f"per_class_{k}"] = {
            c: mean_ci([s["per_class"].get(c, {}).get(k) for s in sums]) for c in classes
        }
    return out


def comparisons_of(pols: list[str], runs: dict[str, list]) -> dict | None:
    """``result["comparisons"]``: the first policy (the one under test) against each
    other one on each of ``ROUND_FIGURES`` (``rounds.compare``: whether the 95%
    intervals across runs are apart, and the paired difference first - other over the
    runs of the same round and seed); None with fewer than two policies."""
    if len(pols) < 2:
        return None
    ref = pols[0]
    keys = run_keys(runs[ref])
    against = {}
    for pol in pols[1:]:
        if run_keys(runs[pol]) != keys:  # _serve_once runs every policy alike
            raise AssertionError(f"runs of {ref} and {pol} do not line up")
        against[pol] = {
            k: compare(
                [s["overall"].get(k) for s, _, _ in runs[ref]],
                [s["overall"].get(k) for s, _, _ in runs[pol]],
            )
            for k in ROUND_FIGURES
        }
    return {"reference": ref, "n": len(keys), "against": against}


def pooled(runs: list[tuple[dict, list, int]]) -> dict:
    """One policy's runs (summary, records, workload seed) as one summary over all their
    requests (throughputs over the summed durations), with each run's figures under
    ``overall.repeats`` and their mean and 95% interval across runs under
    ``overall.rounds`` (``rounds_summary``)."""
    pooled = [r for _, recs, _ in runs for r in recs]
    out = summarize(
        pooled,
        sum(s["overall"]["duration_s"] for s, _, _ in runs),
        class_extra=pooled_energy(runs),
    )
    stalls: dict[str, int] = {}
    for sm, _, _ in runs:
        for cause, n in (sm["overall"].get("stalls") or {}).items():
            stalls[cause] = stalls.get(cause, 0) + n
    if any("stalls" in sm["overall"] for sm, _, _ in runs):
        out["overall"]["stalls"] = stalls
        out["overall"]["stalls_total"] = sum(stalls.values())
    power = pooled_power([s["overall"] for s, _, _ in runs])
    if power is not None:
        out["overall"]["power"] = power
    out["overall"]["repeats"] = [
        {
            "seed": seed,
            "attainment": s["overall"]["attainment"],
            "tpot_attainment": s["overall"]["tpot_attainment"],
            "goodput_tok_s": s["overall"]["goodput_tok_s"],
            "pass_speed_p50": (s["overall"].get("pass_speed") or {}).get("p50"),
            "replayed": s["overall"].get("replayed_tpot"),
            "speed_trace": s["overall"].get("speed_trace"),
            "per_class_attainment": {c: m["attainment"] for c, m in s["per_class"].items()},
            "per_class_tpot_attainment": {
                c: m["tpot_attainment"] for c, m in s["per_class"].items()
            },
        }
        for s, _, seed in runs
    ]
    out["overall"]["rounds"] = rounds_summary(runs)
    return out


def pooled_energy(runs: list[tuple[dict, list, int]]) -> dict[str, dict]:
    """``class_energy`` of pooled runs: each class's energy summed over the runs, per
    output token of all their requests."""
    j: dict[str, float] = {}
    toks: dict[str, int] = {}
    for s, recs, _ in runs:
        for c, m in s["per_class"].items():
            if m.get("energy_j") is not None:
                j[c] = j.get(c, 0.0) + m["energy_j"]
        for r in recs:
            toks[r.cls] = toks.get(r.cls, 0) + r.output_tokens
    out = {
        c: {"energy_j": v, "energy_per_token_j": v / toks[c] if toks.get(c) else None}
        for c, v in j.items()
    }
    if j:
        n = sum(toks.values())
        out["overall"] = {"energy_per_token_j": sum(j.values()) / n if n else None}
    return out


def pooled_power(overalls: list[dict]) -> dict | None:
    """``power_summary`` of pooled runs: means weighted by each run's busy time
    (``model_time_s``; equal weights without it), the highest maximum."""
    runs = [(o.get("power"), o.get("model_time_s") or 1.0) for o in overalls]
    ps = [(p, w) for p, w in runs if p]
    if not ps:
        return None
    out: dict = {}
    for kind in ("measured", "predicted"):
        xs = [(p[kind], w) for p, w in ps if p.get(kind) and p[kind].get("mean_w") is not None]
        if not xs:
            out[kind] = None
            continue
        out[kind] = {
            "mean_w": sum(x["mean_w"] * w for x, w in xs) / sum(w for _, w in xs),
            "max_w": max(x["max_w"] for x, _ in xs),
        }
    return out


def repeat_lines(results: dict, comparisons: dict | None = None) -> str:
    """Per-run attainment of each policy when runs were repeated, their mean and 95%
    interval across runs and the first policy against each other one (``comparisons``,
    ``comparisons_of``); '' without repeats."""
    lines = []
    for pol, s in results.items():
        reps = s["overall"].get("repeats")
        if reps:
            att = " / ".join(f"{100 * r['attainment']:.1f}" for r in reps)
            tpot = " / ".join(
                "-" if r.get("tpot_attainment") is None else f"{100 * r['tpot_attainment']:.1f}"
                for r in reps
            )
            lines.append(f"  {pol}: attainment per run {att} % (TPOT only {tpot} %)")
            speed = [r.get("pass_speed_p50") for r in reps]
            if any(v is not None for v in speed):
                per = " / ".join("-" if v is None else f"{v:.2f}" for v in speed)
                lines.append(f"  {pol}: passes / profile per run (median) {per}")
    if not lines:
        return ""
    out = "runs (in-order; pooled figures above):\n" + "\n".join(lines) + "\n"
    across = rounds_lines(results)
    if across:
        out += "across runs (mean ± half the 95% interval):\n" + "\n".join(across) + "\n"
    pairs = comparison_lines(comparisons)
    if pairs and comparisons is not None:
        out += (
            f"{comparisons['reference']} against each policy (paired over the runs of the "
            "same round and seed; 95% intervals):\n" + "\n".join(pairs) + "\n"
        )
    return out
