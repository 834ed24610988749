"""One step, two scheduler calls: ``run_step`` asks the executor for its inputs,
schedules, executes and updates, in that order; the executor writes no scheduling
state, the scheduler applies its commits and builds the whole trace."""

from __future__ import annotations

import dataclasses

import pytest

from adaserve.bench.workload_spec import WorkItem
from adaserve.core.clock import ManualClock
from adaserve.core.scheduler import Scheduler
from adaserve.core.step import (
    Commit,
    DraftWork,
    SchedulerOutput,
    StepInputs,
    StepOutcome,
    run_step,
)
from adaserve.policies.registry import make_policy
from adaserve.sim.loop import SimConfig, SimRequest


class _Recorder:
    """An executor that prefills each request whole and ends it after one token."""

    def __init__(self, sched: Scheduler, clock: ManualClock):
        self.sched, self.clock, self.calls = sched, clock, []

    def prepare(self) -> StepInputs:
        self.calls.append("prepare")
        return StepInputs((0.5,), can_draft=False)

    def execute(self, out: SchedulerOutput) -> StepOutcome:
        self.calls.append("execute")
        assert self.sched.counters.iterations == 0  # not yet updated
        commits = []
        for r, n in out.batch.prefill:
            assert r.num_cached == 0  # the scheduler has not moved it on
            r.n_tokens += 1
            commits.append(Commit(r, r.num_cached + n, first_token=True, finish="length"))
        self.clock.set(2.0)
        return StepOutcome(
            t_end=2.0,
            ms=1000.0,
            commits=tuple(commits),
            tokens=sum(n for _, n in out.batch.prefill),
            draft=DraftWork(catchup=3, steps=(4,), kv_tokens=9, request_steps=2, drafted=2),
        )


def _sched():
    cfg = SimConfig(default_class=None)
    clock = ManualClock(1.0)
    sched = Scheduler(
        cfg,
        make_policy("ar"),
        clock,
        64,
        max_model_len=1 << 20,
        unloaded_tpot_ms=lambda: 10.0,
    )
    return sched, clock


def test_run_step_schedules_executes_and_updates_in_order():
    sched, clock = _sched()
    cls = sched.cfg.classes[0].name
    reqs = [
        SimRequest(
            WorkItem(i, 0.5, cls, None, None, prompt_len=10, max_tokens=1), sched.class_slo(cls)
        )
        for i in range(2)
    ]
    for r in reqs:
        sched.add(r)
    ex = _Recorder(sched, clock)
    res = run_step(sched, ex)
    assert ex.calls == ["prepare", "execute"]
    assert res.out.runs and res.out.t_start == 1.0 and res.out.view.acc_by_rank == (0.5,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.out.plan_s = 1.0
    # the scheduler applied the commits: cached tokens, first token, finish at t_end
    for r in reqs:
        assert (r.num_cached, r.first_token_at, r.finished_at) == (10, 2.0, 2.0)
        assert r.finish_reason == "length" and r.finished
    assert res.finished == reqs and not sched.has_work()
    tr = res.trace
    assert (tr.t_start, tr.t_end, tr.admitted, tr.prefill) == (1.0, 2.0, [0, 1], {0: 10, 1: 10})
    assert (tr.tokens, tr.draft.tokens, tr.draft.passes, tr.draft.catchup) == (20, 7, 2, 3)
    assert (tr.draft.drafted, tr.kv_tokens, tr.running) == (2, 20, 0)
    assert sched.counters.iterations == 1


def test_run_step_without_running_requests_executes_nothing():
    sched, clock = _sched()
    ex = _Recorder(sched, clock)
    res = run_step(sched, ex)
    assert ex.calls == ["prepare"] and not res.out.runs
    assert res.trace is None and res.finished == []
