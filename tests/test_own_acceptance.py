"""Speculation gives way per request (``SeqState.record_drafts``, ``ReqView.acc_scale``,
``budgeted.planner.own_acceptance``): a request whose drafts the calibrated confidence
says are worth less than the mean request's is planned at a lower acceptance; one that
stopped speculating returns to the mean. Torch-free."""

from __future__ import annotations

from adaserve.core.policy import BatchView, ReqView
from adaserve.core.seq import SeqState
from adaserve.core.slo import SLO
from adaserve.hardware.model import HardwareModel
from adaserve.policies.budgeted import AdaptiveConfig, AdaServePolicy
from adaserve.policies.budgeted.planner import own_acceptance

# a CPU-like pass: a one-token verification 5 ms, a 16-token one 7 ms, a draft step
# 0.8 ms: speculation pays at the calibrated acceptance, not at a third of it
CPU = HardwareModel.from_dict(
    {
        "verify": {"tokens": [1, 16, 64, 256], "latency_ms": [5.0, 7.0, 15.0, 50.0]},
        "draft_step_ms": 0.8,
    }
)
ACC = (0.7, 0.11, 0.05, 0.03)


def test_the_draft_record_scales_and_forgets():
    r = SeqState(1, SLO(tpot_ms=10.0, ttft_ms=1000.0), 0.0)
    assert r.acc_scale == 1.0  # nothing drafted: the mean request
    for _ in range(3):
        r.record_drafts(0.3)  # its trees worth 0.3 of the mean request's
    low = r.acc_scale
    assert 0.3 < low < 0.6  # shrunk toward 1 by one pseudo-step
    for _ in range(15):
        r.record_drafts(None)  # not speculating: the record fades
    assert r.acc_scale > 0.9
    r.record_drafts(1.0)
    assert r.acc_scale > 0.95


def test_the_batch_s_mean_scales_the_calibrated_acceptance_down_never_up():
    def req(rid, scale):
        return ReqView(rid, "interactive", 10.0, 1000.0, 5, 40.0, 100.0, 0, 40, acc_scale=scale)

    assert own_acceptance(ACC, [req(1, 0.5), req(2, 1.0)]) == tuple(a * 0.75 for a in ACC)
    assert own_acceptance(ACC, [req(1, 1.4), req(2, 0.8)]) == ACC  # mean 1.1: unchanged
    assert own_acceptance(ACC, []) == ACC


def _lone_plan(policy, scale):
    r = ReqView(
        rid=7,
        cls="interactive",
        tpot_ms=10.0,
        ttft_ms=1000.0,
        n_out=10,
        decode_ms=45.0,  # ahead of its 10 ms pace: no requirement forces a tree
        waited_ms=100.0,
        prefill_left=0,
        context_len=60,
        acc_scale=scale,
    )
    view = BatchView(now_ms=0.0, requests=[r], free_kv_slots=10**6, hw=CPU, acc_by_rank=ACC)
    plan = policy.plan(view)
    return plan.shapes.get(7, (0, 1))[0]


def test_a_lone_request_whose_drafts_fail_is_planned_shallower_or_not_at_all():
    """At the calibrated acceptance the planner drafts for a lone request; for one
    whose drafts are worth a third of the mean's it drafts less deep (here: not at
    all, a pass of one token being cheaper per token). With the knob off, or for a
    request at the mean, nothing changes."""
    assert _lone_plan(AdaServePolicy(), 1.0) >= 2
    assert _lone_plan(AdaServePolicy(), 0.3) < _lone_plan(AdaServePolicy(), 1.0)
    off = AdaServePolicy(AdaptiveConfig(request_acceptance=False))
    assert _lone_plan(off, 0.3) == _lone_plan(AdaServePolicy(), 1.0)
