"""Figures across rounds (``adaserve.bench.rounds``) and how ``bench serve`` reports them:
``overall.rounds``, ``result["comparisons"]``, the printed lines and ``summary.md``."""

from __future__ import annotations

import argparse
import json
import math
from types import SimpleNamespace

import pytest

from adaserve.bench import cli as bcli
from adaserve.bench.metrics import RequestRecord, summarize
from adaserve.bench.pooling import repeat_lines
from adaserve.bench.rounds import (
    T975,
    compare,
    intervals_separated,
    mean_ci,
    paired_difference,
    t975,
)
from adaserve.bench.workload_spec import WorkloadSpec


# ---------------------------------------------------------------------- the statistics
def test_interval_of_three_values_by_hand():
    """[0.8, 0.9, 1.0]: mean 0.9, s = 0.1, t(0.975, 2) = 4.303, half width
    4.303 * 0.1 / sqrt(3) = 0.2484."""
    st = mean_ci([0.8, 0.9, 1.0])
    assert st["n"] == 3
    assert st["mean"] == pytest.approx(0.9)
    lo, hi = st["ci95"]
    assert (hi - lo) / 2 == pytest.approx(0.2484, abs=1e-4)
    assert (lo + hi) / 2 == pytest.approx(0.9)
    assert t975(2) == pytest.approx(4.303, abs=1e-3)


def test_one_round_has_no_interval_and_nones_are_left_out():
    assert mean_ci([0.7]) == {"mean": 0.7, "ci95": None, "n": 1}
    assert mean_ci([]) == {"mean": None, "ci95": None, "n": 0}
    assert mean_ci([None, 0.5, float("nan"), None]) == {"mean": 0.5, "ci95": None, "n": 1}
    same = mean_ci([0.5, 0.5])  # identical runs: a true zero-width interval
    assert same["ci95"] == [0.5, 0.5]


def _t_cdf(t: float, df: int, steps: int = 4000) -> float:
    """Student t CDF at t > 0 by Simpson's rule over the density from 0 to t."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def pdf(x: float) -> float:
        return c * (1 + x * x / df) ** (-(df + 1) / 2)

    h = t / steps
    s = pdf(0.0) + pdf(t)
    s += sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, steps))
    return 0.5 + s * h / 3


@pytest.mark.parametrize("df", [1, 2, 3, 5, 10, 29, 30, 31, 45, 100])
def test_t_quantiles_are_the_975_points(df):
    """The table (df 1-30) and the expansion beyond both sit at CDF 0.975."""
    assert _t_cdf(t975(df), df) == pytest.approx(0.975, abs=1e-7)


def test_t_quantiles_decrease_to_the_normal_value():
    qs = [t975(d) for d in range(1, 200)]
    assert all(a > b for a, b in zip(qs, qs[1:]))
    assert len(T975) == 30 and t975(10**6) == pytest.approx(1.959964, abs=1e-5)
    with pytest.raises(ValueError):
        t975(0)


def test_intervals_separated_both_ways():
    a = [0.8, 0.9, 1.0]  # [0.652, 1.148]
    far = intervals_separated(a, [0.2, 0.3, 0.4])  # [0.052, 0.548]
    assert far["separated"] is True
    assert far["a"]["mean"] == pytest.approx(0.9) and far["b"]["mean"] == pytest.approx(0.3)
    assert intervals_separated([0.2, 0.3, 0.4], a)["separated"] is True  # symmetric
    assert intervals_separated(a, [0.6, 0.7, 0.8])["separated"] is False  # [0.452, 0.948]
    # one run of either: no interval, so never separated however far the means
    assert intervals_separated([0.9], [0.1])["separated"] is False
    assert intervals_separated(a, [0.1])["separated"] is False


def test_paired_difference_separates_what_the_intervals_do_not():
    """Runs that line up: differences 0.1, 0.1, 0.12 -> mean 0.1067, s = 0.01155, half
    width 4.303 * 0.01155 / sqrt(3) = 0.0287: the interval excludes 0, though each
    policy's own interval (half width 0.5) overlaps the other's."""
    a, b = [0.5, 0.7, 0.9], [0.4, 0.6, 0.78]
    p = paired_difference(a, b)
    assert p["n"] == 3 and p["separated"] is True
    assert p["mean_diff"] == pytest.approx(0.32 / 3)
    lo, hi = p["ci95"]
    assert (hi - lo) / 2 == pytest.approx(0.0287, abs=1e-4)
    both = compare(a, b)
    assert both["intervals"] == {"separated": False}
    assert both["paired"] == p
    # the reverse order: the same interval mirrored, still separated
    q = paired_difference(b, a)
    assert q["mean_diff"] == pytest.approx(-p["mean_diff"]) and q["separated"] is True


def test_paired_difference_not_separated_and_edge_cases():
    p = paired_difference([0.6, 0.5, 0.65], [0.5, 0.6, 0.6])  # differences 0.1, -0.1, 0.05
    assert p["separated"] is False and p["ci95"][0] < 0 < p["ci95"][1]
    one = paired_difference([0.9], [0.1])
    assert one == {"mean_diff": pytest.approx(0.8), "ci95": None, "n": 1, "separated": False}
    # a pair with a missing value is left out
    assert paired_difference([0.9, None, 0.8], [0.1, 0.5, None])["n"] == 1
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference([0.1, 0.2], [0.1])


# ---------------------------------------------------------------------- bench serve
# attained requests of 10 per (policy, round, seed), seeds 1 and 2, two rounds
ATTAINED = {
    "adaserve": {(1, 1): 8, (1, 2): 9, (2, 1): 10, (2, 2): 9},
    "ar": {(1, 1): 5, (1, 2): 6, (2, 1): 6, (2, 2): 5},  # far below: both tests separate
    "drift": {(1, 1): 7, (1, 2): 8, (2, 1): 9, (2, 2): 7},  # paired separates only
    "close": {(1, 1): 8, (1, 2): 8, (2, 1): 10, (2, 2): 9},  # neither
}
N = 10


def _records(k: int) -> list[RequestRecord]:
    """N requests alternating interactive/batch, the first k within their TPOT target:
    10 output tokens each, TPOT 5 ms (attained) or 50 ms (target 10 ms)."""
    out = []
    for i in range(N):
        tpot = 5.0 if i < k else 50.0
        out.append(
            RequestRecord(
                idx=i,
                cls="interactive" if i % 2 == 0 else "batch",
                arrival_s=0.0,
                first_token_s=0.1,
                finish_s=0.1 + 9 * tpot / 1000.0,
                output_tokens=10,
                tpot_target_ms=10.0,
                finish_reason="length",
            )
        )
    return out


class _FakeBackend:
    """``run_serve``'s backend protocol, figures fixed by (policy, round, seed); the
    round is counted from the calls (each round runs each seed once per policy)."""

    def __init__(self, policies):
        self.policies = list(policies)
        self.calls: dict[tuple[str, int], int] = {}

    def workload(self, spec):
        return [object()] * N

    def run(self, spec, items, policy, progress):
        key = (policy, spec.seed)
        self.calls[key] = rnd = self.calls.get(key, 0) + 1
        k = ATTAINED[policy][(rnd, spec.seed)]
        recs = _records(k)
        slos = {"interactive": SimpleNamespace(tpot_ms=10.0, ttft_ms=None)}
        return summarize(recs, 1.0, {"wall_s": 1.0}), recs, None, slos

    def config(self):
        return {"mode": "fake", "policies": self.policies}


def _args(tmp_path, *extra):
    p = argparse.ArgumentParser()
    bcli.add_serve_arguments(p)
    return p.parse_args(["--no-progress", "--no-plots", "--out", str(tmp_path), *extra])


def test_serve_reports_rounds_comparisons_lines_and_markdown(tmp_path, capsys):
    pols = ["adaserve", "ar", "drift", "close"]
    args = _args(tmp_path, "--seeds", "1,2", "--repeat", "2")
    assert bcli.run_serve(args, backend=_FakeBackend(pols)) == 0
    res = json.loads((tmp_path / "result.json").read_text())
    for pol in pols:
        o = res["results"][pol]["overall"]
        reps = o["repeats"]  # unchanged: one entry per run, seed order within a round
        assert [r["seed"] for r in reps] == [1, 2, 1, 2]
        atts = [r["attainment"] for r in reps]
        want = [ATTAINED[pol][k] / N for k in [(1, 1), (1, 2), (2, 1), (2, 2)]]
        assert atts == pytest.approx(want)
        rd = o["rounds"]
        assert rd["n"] == 4
        assert rd["runs"] == [
            {"round": 1, "seed": 1},
            {"round": 1, "seed": 2},
            {"round": 2, "seed": 1},
            {"round": 2, "seed": 2},
        ]
        assert set(rd) == {
            "n",
            "runs",
            "attainment",
            "tpot_attainment",
            "goodput_tok_s",
            "per_class_attainment",
            "per_class_tpot_attainment",
        }
        st = rd["attainment"]
        assert st["n"] == 4 and st["mean"] == pytest.approx(sum(want) / 4)
        assert st["ci95"] == pytest.approx(mean_ci(want)["ci95"])
        # TPOT is the only target here: TPOT attainment equals attainment
        assert rd["tpot_attainment"]["mean"] == pytest.approx(st["mean"])
        # goodput: 10 output tokens per attained request over 1 s
        assert rd["goodput_tok_s"]["mean"] == pytest.approx(10 * N * st["mean"])
        per = rd["per_class_attainment"]
        assert set(per) == {"interactive", "batch"} and per["batch"]["n"] == 4
        # interactive requests are the even indices: ceil(k / 2) of 5 attained
        inter = [math.ceil(ATTAINED[pol][k] / 2) / 5 for k in [(1, 1), (1, 2), (2, 1), (2, 2)]]
        assert per["interactive"]["mean"] == pytest.approx(sum(inter) / 4)

    cmp = res["comparisons"]
    assert cmp["reference"] == "adaserve" and cmp["n"] == 4
    assert list(cmp["against"]) == ["ar", "drift", "close"]
    for other in cmp["against"].values():
        assert set(other) == {"attainment", "tpot_attainment", "goodput_tok_s"}
    ar = cmp["against"]["ar"]["attainment"]
    assert ar["intervals"]["separated"] and ar["paired"]["separated"]
    assert ar["paired"]["mean_diff"] == pytest.approx(0.35)  # diffs .3 .3 .4 .4
    assert ar["paired"]["n"] == 4
    drift = cmp["against"]["drift"]["attainment"]  # diffs .1 .1 .1 .2
    assert not drift["intervals"]["separated"] and drift["paired"]["separated"]
    assert drift["paired"]["mean_diff"] == pytest.approx(0.125)
    close = cmp["against"]["close"]
    assert not close["attainment"]["intervals"]["separated"]
    assert not close["attainment"]["paired"]["separated"]
    assert not close["goodput_tok_s"]["paired"]["separated"]
    assert close["goodput_tok_s"]["paired"]["mean_diff"] == pytest.approx(2.5)  # 10 tok/req

    out = capsys.readouterr().out
    assert "attainment per run" in out  # the existing lines stay
    assert "across runs" in out and " ± " in out
    assert "adaserve vs ar: attainment +35.0 points [" in out

    def line(start: str) -> str:
        (hit,) = [ln for ln in out.splitlines() if ln.startswith("  " + start)]
        return hit

    assert line("adaserve vs ar: attainment").endswith(
        "], separated (paired); intervals apart: separated"
    )
    assert line("adaserve vs drift: attainment").endswith(
        "], separated (paired); intervals overlap: not separated"
    )
    assert line("adaserve vs close: goodput +2.5 tok/s [").endswith(
        "], not separated (paired); intervals overlap: not separated"
    )
    md = (tmp_path / "summary.md").read_text()
    assert "## Across runs" in md and "### adaserve against each policy" in md
    assert "| ar | attainment | +35.0 points [" in md


def test_one_run_gives_no_interval_and_separates_nothing(tmp_path, capsys):
    """One round on one seed: no pooling (no ``overall.rounds``), the comparison says
    so with null intervals, and no across-runs lines are printed."""
    args = _args(tmp_path, "--seed", "1")
    assert bcli.run_serve(args, backend=_FakeBackend(["adaserve", "ar"])) == 0
    res = json.loads((tmp_path / "result.json").read_text())
    assert "rounds" not in res["results"]["adaserve"]["overall"]
    c = res["comparisons"]
    assert c["n"] == 1
    att = c["against"]["ar"]["attainment"]
    assert att["intervals"] == {"separated": False}
    assert att["paired"] == {
        "mean_diff": pytest.approx(0.3),
        "ci95": None,
        "n": 1,
        "separated": False,
    }
    out = capsys.readouterr().out
    assert "across runs" not in out and " vs " not in out
    assert "## Across runs" not in (tmp_path / "summary.md").read_text()


def test_one_policy_has_no_comparisons_and_repeat_lines_name_missing_intervals():
    spec = WorkloadSpec(seed=1)
    args = SimpleNamespace(seeds=None, repeat=2, convergence_window=5.0)
    res, _, _ = bcli._serve_once(_FakeBackend(["adaserve"]), spec, args, False)
    assert "comparisons" not in res
    assert res["results"]["adaserve"]["overall"]["rounds"]["attainment"]["n"] == 2
    # a policy whose runs give one usable value: the line says there is no interval
    res["results"]["adaserve"]["overall"]["rounds"]["goodput_tok_s"] = mean_ci([3.0, None])
    text = repeat_lines(res["results"])
    assert "goodput 3.0 (one run: no interval) tok/s" in text


def test_pass_speed_is_measured_over_predicted():
    """Each run records how its passes compared with the profile (the figure that
    tells a slow round from a bad plan); passes without a prediction are left out."""
    from adaserve.core.policy import Plan
    from adaserve.core.trace import ModelCosts, RunRecorder, StepTrace

    rec = RunRecorder(ModelCosts())
    assert rec.pass_speed() is None
    t = 0.0
    # ten passes predicted 10 ms that took 10, 11, ..., 19 ms; one without a prediction
    for i in range(10):
        rec.record(StepTrace(plan=Plan(), t_start=t, t_end=t + (10 + i) / 1000, predicted_ms=10))
        t += 1
    rec.record(StepTrace(plan=Plan(), t_start=t, t_end=t + 5.0))
    got = rec.pass_speed()
    assert got["n"] == 10
    assert got["p50"] == pytest.approx(1.5) and got["p90"] == pytest.approx(1.9)
    assert got["p25"] <= got["p50"] <= got["p75"] <= got["p90"]


def test_the_speed_trace_counts_the_host_time_between_busy_passes():
    """The run's speed for the simulator (``--speed-trace``): per second of the run, the
    median start-to-start over profiled time; a pass that followed the previous one at
    once starts at its end, one after an idle spell (or a gap longer than itself) at
    its own start."""
    from adaserve.core.counters import Counters
    from adaserve.core.policy import Plan
    from adaserve.core.trace import ModelCosts, RunRecorder, StepTrace

    rec = RunRecorder(ModelCosts(), t0=100.0)
    assert rec.speed_trace() is None

    def step(start: float, ms: float, busy: bool = True, predicted: float = 10.0) -> float:
        end = start + ms / 1000
        rec.record(
            StepTrace(
                plan=Plan(), t_start=start, t_end=end, predicted_ms=predicted, running=int(busy)
            )
        )
        return end

    # second 0: passes of 10 ms with 2 ms between them: 1.2 after the first (1.0)
    t = step(100.0, 10)
    for _ in range(4):
        t = step(t + 0.002, 10)
    # second 1 (after a pass that left work): 10 ms passes 30 ms apart (a pause, not the
    # loop: each counts alone, 1.0), then idle, then one of 15 ms alone (1.5)
    t = step(101.0, 10)
    for _ in range(3):
        t = step(t + 0.030, 10)
    t = step(t + 0.001, 10, busy=False)
    step(t + 0.5, 15)
    step(103.2, 10, predicted=0.0)  # no prediction: no point
    got = rec.speed_trace()
    assert got["t_s"] == [0.0, 1.0]
    assert got["factor"] == [pytest.approx(1.2), pytest.approx(1.0)]
    assert rec.info("ar", Counters(), 0.0, {})["speed_trace"] == got
