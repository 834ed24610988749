"""TPOT-only attainment beside the SLO's, SLO capacity of a rate sweep and goodput as a
share of an oracle's: hand-built records and points, and a small simulated sweep."""

from __future__ import annotations

import json

import pytest

from adaserve.bench.capacity import (
    annotate_sweep,
    goodput_shares,
    meets_slo,
    slo_capacity,
    strictest_class,
)
from adaserve.bench.markdown import serve_summary_md, sweep_summary_md
from adaserve.bench.metrics import RequestRecord, summarize
from adaserve.bench.tables import format_class_table


# ---------------------------------------------------------------------- TPOT only
def _rec(idx, cls, ttft_s, tpot_s, *, n=5, tpot_ms=100.0, ttft_ms=500.0, **kw):
    first = 1.0 + ttft_s
    return RequestRecord(
        idx=idx,
        cls=cls,
        arrival_s=1.0,
        first_token_s=first,
        finish_s=first + tpot_s * (n - 1),
        prompt_tokens=8,
        output_tokens=n,
        tpot_target_ms=tpot_ms,
        ttft_target_ms=ttft_ms,
        finish_reason="length",
        **kw,
    )


def _row(table: str, first: str) -> list[str]:
    return next(line.split() for line in table.splitlines() if line.split()[:1] == [first])


def test_tpot_only_attainment_differs_when_ttft_is_missed():
    recs = [
        _rec(0, "interactive", 0.1, 0.05),  # both within target
        _rec(1, "interactive", 2.0, 0.05),  # TTFT 2000 ms > 500: TPOT ok only
        _rec(2, "interactive", 3.0, 0.06),  # TTFT missed too: TPOT ok only
        _rec(3, "interactive", 0.1, 0.2),  # TPOT 200 ms > 100: neither
        _rec(4, "batch", 5.0, 0.05, ttft_ms=None),  # no TTFT target: both
        RequestRecord(idx=5, cls="batch", arrival_s=0.0, tpot_target_ms=100.0, shed=True),
    ]
    assert [r.attained for r in recs] == [True, False, False, False, True, False]
    assert [r.tpot_attained for r in recs] == [True, True, True, False, True, False]
    assert recs[1].to_dict()["tpot_attained"] and not recs[1].to_dict()["attained"]

    s = summarize(recs, 10.0)
    i, b, o = s["per_class"]["interactive"], s["per_class"]["batch"], s["overall"]
    assert (i["attainment"], i["tpot_attainment"], i["tpot_attained"]) == (0.25, 0.75, 3)
    assert (b["attainment"], b["tpot_attainment"]) == (0.5, 0.5)
    assert o["attainment"] == pytest.approx(2 / 6) and o["tpot_attainment"] == pytest.approx(4 / 6)
    assert o["goodput_tok_s"] == pytest.approx(10 / 10.0)  # goodput stays the SLO's

    result = {"config": {}, "results": {"p": s}}
    table = format_class_table(result)
    head = table.splitlines()[1]
    assert "SLO ok %" in head and "TPOT ok %" in head
    assert _row(table, "interactive")[2:4] == ["25.0", "75.0"]
    assert _row(table, "overall")[2:4] == ["33.3", "66.7"]
    md = serve_summary_md(result)
    assert "| p | 6 | 33.3 | 66.7 |" in md  # overall: SLO ok, TPOT ok
    assert "| p | 4 | 25.0 | 75.0 |" in md  # interactive


# ---------------------------------------------------------------------- capacity
def _run(overall: float, strict: float | None, goodput: float = 100.0) -> dict:
    per_class = {"batch": {"attainment": 1.0, "tpot_target_ms": 150.0}}
    if strict is not None:
        per_class["interactive"] = {"attainment": strict, "tpot_target_ms": 30.0}
    per_class["chat"] = {"attainment": 1.0, "tpot_target_ms": 50.0}
    return {"overall": {"attainment": overall, "goodput_tok_s": goodput}, "per_class": per_class}


def _points(table: dict[str, list]) -> list[dict]:
    rates = [1.0, 2.0, 4.0, 8.0]
    return [
        {"x": x, "results": {pol: _run(*runs[k]) for pol, runs in table.items()}}
        for k, x in enumerate(rates)
    ]


def test_strictest_class_is_the_smallest_tpot_target():
    assert strictest_class({"batch": 150.0, "interactive": 30.0, "chat": 50.0}) == "interactive"
    assert strictest_class({"a": 40.0, "b": None, "c": 20.0}) == "c"
    assert strictest_class({"a": None}) is None


def test_capacity_on_hand_built_points():
    ok = (0.95, 0.95)
    pts = _points(
        {
            "none": [(0.8, 0.95), (0.5, 0.5), (0.4, 0.4), (0.1, 0.1)],
            "all": [ok, ok, ok, (0.9, 0.9)],  # exactly 90% qualifies
            "middle": [ok, ok, (0.85, 0.8), (0.5, 0.2)],
            # overall passes everywhere; the strict class fails from 4 req/s on
            "strict-fails": [ok, (0.96, 0.91), (0.93, 0.7), (0.91, 0.5)],
            "no-strict": [(1.0, None), ok, ok, (0.5, 0.5)],  # 1 req/s: no strict request
            "adaserve": [ok, ok, ok, (0.92, 0.9)],
            "adaserve-x": [ok, (0.95, 0.89), (0.4, 0.4), (0.4, 0.4)],
            "oracle": [ok, ok, ok, ok],
        }
    )
    cap = slo_capacity(pts)
    assert cap["strict_class"] == "interactive" and cap["threshold"] == 0.9
    got = {p: d["capacity_rps"] for p, d in cap["policies"].items()}
    assert got == {
        "none": None,
        "all": 8.0,
        "middle": 2.0,
        "strict-fails": 2.0,
        "no-strict": 4.0,
        "adaserve": 8.0,
        "adaserve-x": 1.0,
        "oracle": 8.0,
    }
    p = cap["policies"]
    assert p["strict-fails"]["qualifying_rates"] == [1.0, 2.0]
    assert p["no-strict"]["qualifying_rates"] == [2.0, 4.0]
    assert p["all"]["at_highest"] and not p["middle"]["at_highest"]
    assert not p["none"]["at_highest"] and p["none"]["lowest_rate"] == 1.0
    # the best baseline: neither adaserve* nor oracle*; "all" (8) beats "no-strict" (4)
    assert cap["best_baseline"] == "all" and cap["best_baseline_rps"] == 8.0
    assert p["adaserve-x"]["ratio_to_best_baseline"] == pytest.approx(1 / 8)
    assert p["adaserve-x"]["ratio_bound"] == "at_most"  # the baseline is at its highest rate
    assert p["adaserve"]["ratio_to_best_baseline"] is None  # both only bounded below
    assert meets_slo(_run(0.9, 0.9), "interactive")
    assert not meets_slo(_run(0.95, 0.89), "interactive")
    assert not meets_slo(_run(0.95, None), "interactive")

    # without the strong baseline, "no-strict" (4) is best: an exact and a lower bound
    pts2 = [
        {"x": q["x"], "results": {k: v for k, v in q["results"].items() if k != "all"}} for q in pts
    ]
    cap2 = slo_capacity(pts2)
    assert cap2["best_baseline"] == "no-strict"
    a = cap2["policies"]["adaserve"]
    assert (a["ratio_to_best_baseline"], a["ratio_bound"]) == (2.0, "at_least")
    b = cap2["policies"]["adaserve-x"]
    assert (b["ratio_to_best_baseline"], b["ratio_bound"]) == (0.25, "exact")

    result = annotate_sweep({"config": {"sweep": "rate"}, "points": pts2})
    text = format_class_table(result)
    assert "SLO capacity" in text
    rows = {line.split()[0]: line for line in text.split("SLO capacity")[1].splitlines()[1:]}
    assert "< 1" in rows["none"] and "≥ 8" in rows["adaserve"] and "≥ 2.00x" in rows["adaserve"]
    assert "0.25x" in rows["adaserve-x"] and "(best baseline)" in rows["no-strict"]
    md = sweep_summary_md(result)
    assert "## SLO capacity" in md and "| adaserve | ≥ 8 | 1, 2, 4, 8 | ≥ 2.00x |" in md
    assert "| strict-fails | 2 | 1, 2 |  |" in md


def test_goodput_share_of_a_reference_policy():
    pts = [
        {"x": 1.0, "results": {"ref": _run(1, 1, 200.0), "a": _run(1, 1, 150.0)}},
        {"x": 2.0, "results": {"ref": _run(1, 1, 0.0), "a": _run(1, 1, 10.0)}},
    ]
    assert goodput_shares(pts[0]["results"], "ref") == {"ref": 1.0, "a": 0.75}
    assert goodput_shares(pts[1]["results"], "ref") == {"ref": None, "a": None}
    # no oracle among the policies: nothing added unless a reference is named
    plain = annotate_sweep(
        {"config": {"sweep": "slo-scale"}, "points": json.loads(json.dumps(pts))}
    )
    assert "goodput_reference" not in plain and "capacity" not in plain
    assert "% of" not in format_class_table(plain)
    res = annotate_sweep({"config": {"sweep": "slo-scale"}, "points": pts}, reference="ref")
    assert res["goodput_reference"] == "ref" and res["points"][0]["goodput_share"]["a"] == 0.75
    assert "% of ref goodput" in format_class_table(res)
    md = sweep_summary_md(res)
    assert "### Goodput as a share of ref's (%)\n\n| slo-scale | ref | a |" in md
    assert "| 1 | 100.0 | 75.0 |\n| 2 | - | - |" in md
    # a policy named oracle* is the reference by itself
    pts3 = [{"x": 1.0, "results": {"a": _run(1, 1, 50.0), "oracle:4x4": _run(1, 1, 100.0)}}]
    res3 = annotate_sweep({"config": {"sweep": "rate"}, "points": pts3})
    assert res3["goodput_reference"] == "oracle:4x4"
    assert res3["points"][0]["goodput_share"] == {"a": 0.5, "oracle:4x4": 1.0}


# ---------------------------------------------------------------------- simulated
def test_simulated_rate_sweep_reports_the_capacity_its_points_give(tmp_path, capsys):
    from adaserve.cli import main

    prof = tmp_path / "p.json"
    prof.write_text(
        json.dumps(
            {
                "verify": {"tokens": [1, 64, 256, 1024], "latency_ms": [20.0, 24.0, 40.0, 110.0]},
                "draft_step_ms": 2.0,
            }
        )
    )
    out = tmp_path / "s"
    args = ["simulate", "--profile", str(prof), "--accept", "0.7", "--duration", "4"]
    args += ["--dataset", "random", "--policies", "adaserve,ar,spec-chain:4"]
    args += ["--sweep", "rate", "--rates", "4,12,24", "--out", str(out)]
    assert main([*args, "--no-progress", "--no-plots"]) == 0
    res = json.loads((out / "result.json").read_text())
    pts = res["points"]
    assert [p["x"] for p in pts] == [4, 12, 24]

    # recompute from the per-rate, per-class results
    targets: dict[str, float] = {}
    for p in pts:
        for r in p["results"].values():
            for c, m in r["per_class"].items():
                targets[c] = min(m["tpot_target_ms"], targets.get(c, m["tpot_target_ms"]))
    strict = min(targets, key=targets.get)
    assert len(targets) >= 2 and strict == "interactive"
    want, met_any, failed_any = {}, False, False
    for pol in res["config"]["policies"]:
        good = []
        for p in pts:
            r = p["results"][pol]
            s = r["per_class"].get(strict, {}).get("attainment")
            ok = r["overall"]["attainment"] >= 0.9 and s is not None and s >= 0.9
            met_any, failed_any = met_any or ok, failed_any or not ok
            if ok:
                good.append(p["x"])
        want[pol] = max(good) if good else None
    assert met_any and failed_any  # the sweep spans the capacity: the check can fail
    cap = res["capacity"]
    assert cap["strict_class"] == strict
    assert {p: d["capacity_rps"] for p, d in cap["policies"].items()} == want
    baselines = {p: c for p, c in want.items() if not p.startswith("adaserve") and c}
    best = max(baselines.values()) if baselines else None
    assert cap["best_baseline_rps"] == best
    for p in pts:  # the TPOT-only figure is in every result and never below the SLO's
        for r in p["results"].values():
            for m in [r["overall"], *r["per_class"].values()]:
                assert m["tpot_attainment"] >= m["attainment"]
    printed = capsys.readouterr().out
    assert "SLO capacity" in printed and "TPOT ok %" in printed
    md = (out / "summary.md").read_text()
    assert "## SLO capacity" in md and "TPOT-only attainment (TPOT ok %)" in md
