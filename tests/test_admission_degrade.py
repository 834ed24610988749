"""Degrade instead of refuse (issue 31 item 3), in the torch-free core on a manual
clock: a request with ``on_overload="degrade"`` that its class cannot admit is admitted
in the first class along the ``degrade_to`` chain that can keep its promise; without it,
or when no class can, it is refused as before."""

from __future__ import annotations

import dataclasses

import pytest
from test_admission import HW, _Idle, _pass, _Req

from adaserve.core.clock import ManualClock
from adaserve.core.config import SchedulerConfig
from adaserve.core.scheduler import Scheduler
from adaserve.core.slo import SLO, SLOClass
from adaserve.errors import AdmissionRejected, InvalidRequestError

CLASSES = (
    SLOClass("interactive", tpot_ms=30.0, ttft_ms=1000, rank=0, degrade_to="chat"),
    SLOClass("chat", tpot_ms=60.0, ttft_ms=1200, rank=1, degrade_to="batch"),
    SLOClass("batch", tpot_ms=200.0, ttft_ms=60000, rank=2),
)


def _sched(clock) -> Scheduler:
    cfg = SchedulerConfig(classes=CLASSES, default_class=None, admission=True)
    return Scheduler(
        cfg, _Idle(), clock, 4096, max_model_len=4096, unloaded_tpot_ms=lambda: 10.0, hw=HW
    )


def _slo(cls: str, on_overload: str = "refuse") -> SLO:
    c = next(c for c in CLASSES if c.name == cls)
    return dataclasses.replace(c.resolve(10.0), on_overload=on_overload)


def _backlog(sched, clock):
    """Passes of a full chunk measured at 250 ms, then 3 interactive prompts of 256
    tokens queued at t=4 s: 750 ms of prefill ahead of anything with a later deadline."""
    for _ in range(20):
        _pass(sched, 0.0, 0.25, prefill={99: 256})
    clock.set(4.0)
    for i in range(3):
        sched.add(_Req(i, _slo("interactive"), 4.0, prompt=256))


def test_a_degradable_request_is_admitted_in_the_first_class_that_can_keep_its_promise():
    clock = ManualClock(0.0)
    sched = _sched(clock)
    _backlog(sched, clock)
    # refused as it asks: four passes of 250 ms against interactive's 1 s
    with pytest.raises(AdmissionRejected) as ei:
        sched.add(_Req(10, _slo("interactive"), 4.0, prompt=256))
    assert ei.value.reason == "ttft"
    ac = sched.admission
    # chat would be late too (the same 1 s of prefill against 1.2 s less the
    # prediction's margin), batch is not: the degradable request skips chat and is admitted in batch
    probe = _Req(11, _slo("chat"), 4.0, prompt=256)
    assert ac.verdict(probe, 4.0) is not None
    r = _Req(12, _slo("interactive", "degrade"), 4.0, prompt=256)
    sched.add(r)
    assert r in sched.waiting
    assert r.slo.cls == "batch" and r.degraded_from == "interactive"
    assert r.slo.ttft_ms == 60000 and r.slo.on_overload == "degrade"
    assert sched.counters.shed == {"ttft": 1}
    assert sched.counters.degraded_on_admission == {"ttft": 1}


def test_a_degradable_request_keeps_its_class_when_that_class_can_admit_it():
    clock = ManualClock(0.0)
    sched = _sched(clock)
    _backlog(sched, clock)
    r = _Req(10, _slo("interactive", "degrade"), 4.0, prompt=10)  # a short one fits
    sched.add(r)
    assert r.slo.cls == "interactive" and r.degraded_from is None
    assert sched.counters.degraded_on_admission == {}


def test_refused_when_no_class_along_the_chain_can_admit_it():
    clock = ManualClock(0.0)
    sched = _sched(clock)
    _backlog(sched, clock)
    # chat is the end of its own chain here: a request that may only go to chat
    cfg = dataclasses.replace(
        sched.cfg, classes=(CLASSES[0], dataclasses.replace(CLASSES[1], degrade_to=None))
    )
    s2 = Scheduler(
        cfg, _Idle(), clock, 4096, max_model_len=4096, unloaded_tpot_ms=lambda: 10.0, hw=HW
    )
    for _ in range(20):
        _pass(s2, 0.0, 0.25, prefill={99: 256})
    for i in range(3):
        s2.add(_Req(i, _slo("interactive"), 4.0, prompt=256))
    r = _Req(10, _slo("interactive", "degrade"), 4.0, prompt=256)
    with pytest.raises(AdmissionRejected) as ei:
        s2.add(r)
    # refused for its own class's reason, its SLO untouched
    assert "target of class 'interactive'" in str(ei.value)
    assert r.slo.cls == "interactive" and r.degraded_from is None
    assert s2.counters.shed == {"ttft": 1} and s2.counters.degraded_on_admission == {}


def test_a_full_queue_is_not_degraded_around():
    clock = ManualClock(0.0)
    cfg = SchedulerConfig(classes=CLASSES, default_class=None, admission=True, max_waiting=1)
    sched = Scheduler(
        cfg, _Idle(), clock, 4096, max_model_len=4096, unloaded_tpot_ms=lambda: 10.0, hw=HW
    )
    sched.add(_Req(0, _slo("batch"), 0.0))
    with pytest.raises(AdmissionRejected) as ei:
        sched.add(_Req(1, _slo("interactive", "degrade"), 0.0))
    assert ei.value.reason == "queue_full"
    assert sched.counters.shed == {"queue_full": 1}


def test_the_chain_stops_at_a_cycle_and_at_unknown_classes():
    clock = ManualClock(0.0)
    classes = (
        SLOClass("a", ttft_ms=100, rank=0, degrade_to="b"),
        SLOClass("b", ttft_ms=200, rank=1, degrade_to="a"),
        SLOClass("c", ttft_ms=300, rank=2, degrade_to="nowhere"),
    )
    cfg = SchedulerConfig(classes=classes, default_class=None, admission=True)
    s = Scheduler(cfg, _Idle(), clock, 4096, max_model_len=4096, unloaded_tpot_ms=lambda: 10.0)
    assert s.degrade_chain("a") == ["b"] and s.degrade_chain("c") == []
    with pytest.raises(InvalidRequestError):
        SLO(on_overload="queue")
