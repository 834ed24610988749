"""Metrics on hand-built request timings give hand-computed values."""

from __future__ import annotations

import pytest

from adaserve.bench.metrics import (
    RequestRecord,
    dist,
    record_flops,
    rolling_attainment,
    shift_convergence,
    summarize,
)
from adaserve.bench.tables import format_class_table
from adaserve.hardware.energy import EnergyTally, device_energy


def _records():
    a = RequestRecord(  # TTFT 100, TPOT 100: attains
        idx=0,
        cls="interactive",
        arrival_s=0.0,
        first_token_s=0.1,
        finish_s=0.4,
        token_times_s=[0.1, 0.2, 0.2, 0.4],
        prompt_tokens=10,
        output_tokens=4,
        tpot_target_ms=120,
        ttft_target_ms=200,
        finish_reason="length",
    )
    b = RequestRecord(  # TTFT 500, TPOT 200: violates both
        idx=1,
        cls="interactive",
        arrival_s=1.0,
        first_token_s=1.5,
        finish_s=2.1,
        token_times_s=[1.5, 1.7, 1.9, 2.1],
        prompt_tokens=10,
        output_tokens=4,
        tpot_target_ms=120,
        ttft_target_ms=200,
        finish_reason="length",
    )
    c = RequestRecord(  # TTFT 100, TPOT 100: attains
        idx=2,
        cls="batch",
        arrival_s=0.5,
        first_token_s=0.6,
        finish_s=1.0,
        token_times_s=[0.6, 0.7, 0.8, 0.9, 1.0],
        prompt_tokens=20,
        output_tokens=5,
        tpot_target_ms=150,
        finish_reason="stop",
    )
    d = RequestRecord(idx=3, cls="batch", arrival_s=1.2, shed=True, error="shed: capacity")
    return [a, b, c, d]


def test_per_request_properties():
    a, b, c, d = _records()
    assert a.ttft_ms == pytest.approx(100) and a.tpot_ms == pytest.approx(100)
    assert a.itl_ms == pytest.approx([100, 200])  # same-iteration tokens form one delivery
    assert a.e2e_ms == pytest.approx(400)
    assert a.attained and not b.attained and c.attained and not d.attained
    assert b.tpot_ms == pytest.approx(200) and b.ttft_ms == pytest.approx(500)
    assert d.ttft_ms is None and d.tpot_ms is None and not d.completed
    one = RequestRecord(
        0, "x", 0.0, 0.05, 0.05, [0.05], 3, 1, tpot_target_ms=1, finish_reason="length"
    )
    assert one.tpot_ms is None and one.attained  # a single token has no TPOT
    cut = RequestRecord(0, "x", 0.0, 0.05, 0.1, [0.05, 0.1], 3, 2, finish_reason="abort")
    assert not cut.attained
    assert RequestRecord.from_dict(a.to_dict()) == a


def test_summary_matches_hand_computation():
    s = summarize(_records(), duration_s=2.0)
    o = s["overall"]
    assert o["requests"] == 4 and o["completed"] == 3 and o["shed"] == 1 and o["errors"] == 0
    assert o["attained"] == 2 and o["violations"] == 2 and o["attainment"] == 0.5
    assert o["throughput_tok_s"] == pytest.approx((4 + 4 + 5) / 2)
    assert o["goodput_tok_s"] == pytest.approx((4 + 5) / 2)
    assert o["request_goodput_rps"] == pytest.approx(1.0)
    assert o["request_throughput_rps"] == pytest.approx(1.5)
    # TTFT 100, 500, 100 -> linear-interpolation percentiles
    assert o["ttft_ms"]["mean"] == pytest.approx(700 / 3)
    assert o["ttft_ms"]["p50"] == pytest.approx(100)
    assert o["ttft_ms"]["p95"] == pytest.approx(100 + 0.9 * 400)
    assert o["ttft_ms"]["p99"] == pytest.approx(100 + 0.98 * 400)
    # TPOT 100, 200, 100
    assert o["tpot_ms"]["mean"] == pytest.approx(400 / 3)
    assert o["tpot_ms"]["p99"] == pytest.approx(100 + 0.98 * 100)
    # ITL: a [100, 200], b [200, 200, 200], c [100] * 4
    itl = [100, 200, 200, 200, 200, 100, 100, 100, 100]
    assert o["itl_ms"]["mean"] == pytest.approx(sum(itl) / len(itl))
    assert o["itl_ms"]["p50"] == pytest.approx(100)
    assert o["e2e_ms"]["p50"] == pytest.approx(500)  # 400, 1100, 500
    i = s["per_class"]["interactive"]
    assert i["requests"] == 2 and i["attainment"] == 0.5 and i["goodput_tok_s"] == 2.0
    bt = s["per_class"]["batch"]
    assert bt["requests"] == 2 and bt["violations"] == 1 and bt["goodput_tok_s"] == 2.5
    assert bt["tpot_target_ms"] == 150
    for m in (o, i, bt):
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(m[k]) == {"mean", "p50", "p95", "p99"}
    table = format_class_table({"results": {"p": s}})
    assert "interactive" in table and "overall" in table and "50.0" in table


def test_dist_of_nothing_and_extra():
    assert dist([]) == {"mean": None, "p50": None, "p95": None, "p99": None}
    s = summarize([], 1.0, {"peak_kv_usage": 0.3})
    assert s["overall"]["requests"] == 0 and s["overall"]["attainment"] is None
    assert s["overall"]["peak_kv_usage"] == 0.3 and s["per_class"] == {}


def test_speculation_counts_and_rejected_flops_share():
    r = RequestRecord(
        idx=0,
        cls="c",
        arrival_s=0,
        first_token_s=0.1,
        finish_s=1,
        prompt_tokens=5,
        output_tokens=10,
        drafted=12,
        verified=10,
        accepted=4,
        finish_reason="length",
    )
    assert r.decode_steps == 5  # 10 outputs = 1 (prefill) + 5 steps x (1 + accepted)
    total, rej = record_flops(r, 2.0, 1.0)
    assert total == 2 * (5 + 5 + 10) + 1 * (5 + 10 + 12) and rej == 2 * 6 + 1 * 8
    o = summarize([r], 1.0, flops_per_token=(2.0, 1.0))["overall"]
    assert o["rejected_flops_share"] == pytest.approx(20 / 67)
    assert o["acceptance_rate"] == pytest.approx(0.4) and o["rejected_tokens"] == 6


def test_energy_model():
    e = device_energy("cpu", pj_per_flop=2.0, pj_per_byte=10.0)
    t = EnergyTally()
    t.add_iteration(10, 4, 3, 100, 1e3, 1e2, 5e3, 1e3, 8)
    assert t.flops == 10 * 1e3 + 4 * 1e2
    assert t.bytes_moved == 5e3 + 3 * 1e3 + 100 * 8
    s = t.summary(e, output_tokens=4)
    assert s["energy_j"] == pytest.approx((10400 * 2 + 8800 * 10) * 1e-12)
    assert s["energy_per_token_mj"] == pytest.approx(s["energy_j"] / 4 * 1000)
    assert device_energy("cuda:0").name == "a100"


def _strict(t, ok):
    return RequestRecord(
        idx=int(t * 100),
        cls="interactive",
        arrival_s=t - 0.2,
        first_token_s=t - 0.1,
        finish_s=t,
        token_times_s=[t - 0.1, t],
        output_tokens=2,
        tpot_target_ms=1e6 if ok else 1.0,
        finish_reason="length",
    )


def test_shift_convergence_on_a_hand_built_timeline():
    # strict requests finish every 0.25 s; those finishing in (10, 13] violate
    recs = [_strict(k * 0.25, not (10 < k * 0.25 <= 13)) for k in range(1, 81)]
    times, vals = rolling_attainment(recs, "interactive", 2.0, 20.0, step_s=0.1)
    assert vals[(times > 4) & (times < 9.9)].min() == 1.0
    (c,) = shift_convergence(recs, [10.0], "interactive", 20.0, window_s=2.0)
    assert c["pre_steady"] == 1.0 and c["post_steady"] == 1.0 and c["dip"] == 0.0
    # the last window holding a violation ends at 13 + 2 s
    assert c["convergence_s"] == pytest.approx(5.0, abs=0.3)
    # no shift effect -> converged at once; no strict requests -> unknown
    calm = [_strict(k * 0.25, True) for k in range(1, 81)]
    assert shift_convergence(calm, [10.0], "interactive", 20.0)[0]["convergence_s"] == 0.0
    assert shift_convergence(calm, [10.0], "chat", 20.0)[0]["convergence_s"] is None
