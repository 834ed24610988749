"""SLO-aware pass composition (policies/composition.py, AdaServePolicy._compose) and
degradation that keeps a request's SLO scale and overrides (core/scheduler.py)."""

from __future__ import annotations

import math

import pytest

from adaserve.core.clock import ManualClock
from adaserve.core.config import SchedulerConfig
from adaserve.core.policy import BatchView, Plan, Policy, ReqView
from adaserve.core.scheduler import Scheduler, looser_slo
from adaserve.core.seq import SeqState
from adaserve.core.slo import SLO, SLOClass
from adaserve.hardware.model import HardwareModel
from adaserve.policies import composition
from adaserve.policies.budgeted import AdaptiveConfig, AdaServePolicy, DynTreePolicy
from adaserve.policies.typical_tree import gain_curve

# a GPU-like pass: the weights cost 25 ms whatever the batch; a prefill token ~0.2 ms
GPU = HardwareModel.from_dict(
    {
        "verify": {
            "tokens": [1, 16, 64, 256, 1024],
            "latency_ms": [25.0, 25.5, 30.0, 76.0, 230.0],
        },
        "draft_step_ms": 4.7,
    }
)
ACC = (0.7, 0.11, 0.05, 0.03)


def decoder(rid, tpot, *, behind_ms=0.0, n_out=40, rank=0) -> ReqView:
    """A decoding request ``behind_ms`` behind its target pace (negative: ahead)."""
    return ReqView(
        rid=rid,
        cls="strict" if rank == 0 else "relaxed",
        tpot_ms=tpot,
        ttft_ms=2000.0,
        n_out=n_out,
        decode_ms=(n_out - 1) * tpot + behind_ms,
        waited_ms=5000.0,
        prefill_left=0,
        context_len=400,
        rank=rank,
        max_tokens=200,
    )


def prompt(rid, tokens, waited_ms, *, ttft_ms=30000.0, rank=2) -> ReqView:
    """A request still prefilling ``tokens`` prompt tokens."""
    return ReqView(
        rid=rid,
        cls="batch" if rank else "strict",
        tpot_ms=150.0,
        ttft_ms=ttft_ms,
        n_out=0,
        decode_ms=0.0,
        waited_ms=waited_ms,
        prefill_left=tokens,
        context_len=tokens,
        rank=rank,
    )


def plan_of(pol, reqs) -> Plan:
    return pol.plan(
        BatchView(now_ms=0.0, requests=reqs, free_kv_slots=10**6, hw=GPU, acc_by_rank=ACC)
    )


def test_relaxed_prefill_waits_for_its_latest_start_and_never_past_it():
    """Strict decoders behind their aim leave no slack: a relaxed prompt waits, then
    starts in time to see its first token within its TTFT (and not much earlier)."""
    pol = AdaServePolicy(AdaptiveConfig(min_slack_tokens=64))
    # behind their aim (target less the margin): each needs a depth-3 tree to make up
    # its deficit within catch_up_tokens, which the plan gives with little to spare
    strict = [decoder(i, 30.6, behind_ms=-60.0) for i in range(6)]
    plan = plan_of(pol, strict)
    assert plan.state.choice.depth >= 2 and all(
        pol.requirement(r, plan.t_iter_ms) > 2 for r in strict
    )
    ttft, tokens, step = 4000.0, 1500, 20.0
    first = None
    for k in range(int(ttft / step)):
        w = k * step
        plan = plan_of(pol, [*strict, prompt(99, tokens, w, ttft_ms=ttft)])
        if plan.prefill.get(99, 0) > 0:
            first, t_pass = w, plan.t_iter_ms
            assert plan.prefill[99] == pol.cfg.prefill_chunk  # firm: a full chunk
            break
    assert first is not None, "the relaxed prefill never started"
    passes = math.ceil(tokens / pol.cfg.prefill_chunk)
    # never past its latest start: all its passes still fit in the TTFT
    assert first + passes * t_pass <= ttft
    # and deferred until about then (within the margin and two passes of headroom)
    assert first >= ttft - passes * t_pass * (1 + pol.cfg.slo_margin) - 2 * t_pass - step
    assert first > 0.5 * ttft
    # the same batch under dyn-tree (no composition) prefills it at once
    plan = DynTreePolicy().plan(
        BatchView(
            now_ms=0.0,
            requests=[*strict, prompt(99, tokens, 0.0, ttft_ms=ttft)],
            free_kv_slots=10**6,
            hw=GPU,
            acc_by_rank=ACC,
        )
    )
    assert plan.prefill.get(99, 0) > 0


def test_relaxed_prefill_runs_at_once_when_everyone_is_on_pace():
    pol = AdaServePolicy()
    # well ahead of their pace: a longer pass costs them nothing
    ahead = [decoder(i, 30.6, behind_ms=-600.0) for i in range(4)]
    plan = plan_of(pol, [*ahead, prompt(99, 1500, 0.0)])
    assert plan.prefill.get(99) == pol.cfg.prefill_chunk
    # and with nobody decoding at all
    plan = plan_of(pol, [prompt(99, 1500, 0.0)])
    assert plan.prefill.get(99) == pol.cfg.prefill_chunk


def test_slack_sizes_the_soft_prefill():
    """Some slack: the soft prefill takes what fits, no more (a pass within the
    on-pace decoders' cap)."""
    pol = AdaServePolicy()
    dec = [decoder(i, 30.6, behind_ms=-60.0) for i in range(4)]
    plan = plan_of(pol, [*dec, prompt(99, 1500, 0.0)])
    n = plan.prefill.get(99, 0)
    assert 0 < n < pol.cfg.prefill_chunk
    # the composed pass keeps every decoder on pace with the tree it gets
    ch = plan.state.choice
    g = gain_curve(ch.depth, ch.width, ACC)
    for r, k in zip(dec, ch.alloc):
        assert pol.requirement(r, plan.t_iter_ms) <= 1.0 + g[min(k, len(g) - 1)] + 1e-6
    # a full chunk would not have fitted: someone falls behind under it
    full = plan_of(AdaServePolicy(AdaptiveConfig(compose=False)), [*dec, prompt(99, 1500, 0.0)])
    fc = full.state.choice
    g = gain_curve(fc.depth, fc.width, ACC)
    assert any(
        pol.requirement(r, full.t_iter_ms) > 1.0 + g[min(k, len(g) - 1)]
        for r, k in zip(dec, fc.alloc)
    )


def test_strict_prefill_is_never_deferred():
    pol = AdaServePolicy()
    strict = [decoder(i, 30.6, behind_ms=25.0) for i in range(6)]
    plan = plan_of(pol, [*strict, prompt(50, 200, 0.0, ttft_ms=2000.0, rank=0)])
    assert plan.prefill.get(50) == 200


# a CPU-like pass: its cost grows steeply with its tokens (64 tokens = 3x one token)
CPU = HardwareModel.from_dict(
    {
        "verify": {"tokens": [1, 16, 64, 256], "latency_ms": [10.0, 16.0, 30.0, 110.0]},
        "draft_step_ms": 1.5,
    }
)


def test_on_steep_hardware_strict_prefill_waits_for_its_latest_start():
    """Where a pass's cost is steep (``core.config.STEEP``), a strict prompt's chunk
    costs its own class's decoders more than its TTFT needs: its prefill is soft like
    a relaxed one's, deferred while the strict decoders are behind their aim, and run
    once its TTFT deadline needs it."""
    from adaserve.core.config import STEEP

    assert CPU.steepness() >= STEEP > GPU.steepness()
    pol = AdaServePolicy()
    strict = [decoder(i, 20.0) for i in range(4)]  # at their target: behind their aim

    def run(waited_ms, hw):
        view = BatchView(
            now_ms=0.0,
            requests=[*strict, prompt(50, 200, waited_ms, ttft_ms=2000.0, rank=0)],
            free_kv_slots=10**6,
            hw=hw,
            acc_by_rank=ACC,
        )
        return pol.plan(view).prefill.get(50, 0)

    assert 0 < run(0.0, CPU) < 50  # 2 s to its deadline: only what the slack allows
    assert run(1800.0, CPU) == 200  # at its latest start: all of it at once
    assert run(0.0, GPU) == 200  # flat hardware: strict prefill is firm at once


def test_earliest_deadline_first_among_urgent_prefills():
    """Two relaxed prompts at their latest start: the earlier deadline is served first,
    and the cumulative tokens make the later one urgent sooner."""
    split = composition.split_prefill(
        [prompt(1, 1000, 29000.0), prompt(2, 1000, 29500.0)],
        chunk=256,
        t_pass_ms=100.0,
        margin=0.15,
        defer_rank=1,
        no_ttft_ms=30000.0,
    )
    assert [r.rid for r in split.firm] == [2, 1]
    # alone, request 1 would not be urgent yet (its latest start: 30 s less 4 passes
    # of 115 ms less one of headroom = 29.44 s; behind request 2, 28.98 s)
    alone = composition.split_prefill(
        [prompt(1, 1000, 29000.0)],
        chunk=256,
        t_pass_ms=100.0,
        margin=0.15,
        defer_rank=1,
        no_ttft_ms=30000.0,
    )
    assert not alone.firm and [r.rid for r in alone.soft] == [1]


def test_pass_cap_ignores_requests_past_helping_and_those_without_targets():
    import numpy as np

    need = np.array([1.5, 9.0, 1.0])
    gain = np.array([0.7, 2.0, 0.0])
    slope = np.array([0.05, 1.0, 0.0])
    base = np.zeros(3)
    has = np.array([True, True, False])
    cap = composition.pass_cap_ms(need, gain, slope, base, has, reach=2.5)
    assert cap == pytest.approx(1.7 / 0.05)
    assert composition.pass_cap_ms(need[1:], gain[1:], slope[1:], base[1:], has[1:], 2.5) == (
        math.inf
    )


# ----------------------------------------------------------------- degradation


CLASSES = (
    SLOClass("interactive", tpot_ms=30.0, ttft_ms=2000, rank=0, degrade_to="chat"),
    SLOClass("chat", tpot_ms=50.0, ttft_ms=4000, rank=1),
)


class _Seq(SeqState):
    __slots__ = ()

    @property
    def num_tokens(self) -> int:
        return 10

    @property
    def prompt_len(self) -> int:
        return 10

    @property
    def max_new_tokens(self) -> int:
        return 10


class _Degrader(Policy):
    name = "degrader"

    def plan(self, view):
        return Plan(degrade={r.rid: "looser" for r in view.requests})


def test_degradation_keeps_the_slo_scale_and_overrides():
    cfg = SchedulerConfig(classes=CLASSES, default_class=None)
    sched = Scheduler(
        cfg,
        _Degrader(),
        ManualClock(0.0),
        64,
        max_model_len=1000,
        unloaded_tpot_ms=lambda: 10.0,
    )
    scaled = _Seq(1, SLO(tpot_ms=15.0, ttft_ms=2000.0, cls="interactive"), 0.0)  # scale 0.5
    custom = _Seq(2, SLO(tpot_ms=30.0, ttft_ms=500.0, cls="interactive"), 0.0)  # TTFT override
    for r in (scaled, custom):
        sched.add(r)
    sched.begin_step()
    sched.admit()
    sched.plan(sched.view())
    assert scaled.slo == SLO(tpot_ms=25.0, ttft_ms=4000.0, cls="chat")
    assert custom.slo == SLO(tpot_ms=50.0, ttft_ms=1000.0, cls="chat")
    assert scaled.degraded_from == custom.degraded_from == "interactive"


def test_looser_slo_without_targets():
    own = SLO(cls="interactive")
    assert looser_slo(own, own, SLO(tpot_ms=50.0, cls="chat")).tpot_ms == 50.0
    assert looser_slo(SLO(tpot_ms=7.0, cls="a"), SLO(cls="a"), SLO(cls="b")).tpot_ms == 7.0


# ----------------------------------------------------------------- exploration


def test_exploration_drafts_wide_trees_now_and_then():
    """Chains teach the calibrator nothing about second-ranked children: every
    explore_every-th plan drafts width-2 trees instead (adaserve only)."""
    dec = [decoder(i, 30.6, behind_ms=-60.0) for i in range(4)]

    def widths(pol, n=12):
        return [plan_of(pol, dec).state.choice.width for _ in range(n)]

    assert widths(AdaServePolicy(AdaptiveConfig(explore_every=4))) == [1, 1, 1, 2] * 3
    assert set(widths(AdaServePolicy(AdaptiveConfig(explore_every=0)))) == {1}
    assert set(widths(DynTreePolicy(AdaptiveConfig(explore_every=4)))) == {1}
    # once second-ranked children are accepted often enough, wide trees are options
    # on every plan (chosen by their predicted rate), not only on exploration plans
    pol = AdaServePolicy(AdaptiveConfig(explore_every=0))
    wide = BatchView(
        now_ms=0.0, requests=dec, free_kv_slots=10**6, hw=GPU, acc_by_rank=(0.5, 0.3, 0.1)
    )
    assert pol._widths(len(dec)) == (1, 2) or pol.plan(wide) and pol._widths(len(dec)) == (1, 2)


def test_relaxed_decoders_sit_out_for_a_strict_one_short_of_its_requirement():
    """``sit_out``: a batch decoder far inside its target leaves the pass to a strict
    decoder the plan leaves short; one near its target stays; the scheduler honours
    the plan's ``skip``."""
    strict = decoder(0, 30.6)  # at its target, so behind its aim: short at every depth
    easy = decoder(1, 150.0, rank=2)
    easy.decode_ms = 39 * 40.0  # mean TPOT 40 ms against 150
    tight = decoder(2, 150.0, rank=2)  # exactly at its target
    reqs = [strict, easy, tight]
    on = AdaServePolicy(AdaptiveConfig(sit_out=True))
    plan = plan_of(on, reqs)
    assert plan.skip == {1}
    assert 1 not in plan.shapes and 1 not in plan.state.arrays.rid.tolist()
    assert plan_of(AdaServePolicy(), reqs).skip == set()  # off by default
    # a strict decoder too far behind for any tree to put it back on pace this pass
    # still has the relaxed one sit out: a shorter pass is what helps it
    hopeless = decoder(0, 30.6, behind_ms=2000.0)
    assert plan_of(on, [hopeless, easy, tight]).skip == {1}
    # a strict decoder on pace has nobody sit out
    ahead = decoder(0, 30.6, behind_ms=-400.0)
    assert plan_of(on, [ahead, easy, tight]).skip == set()


class _Decoding(_Seq):
    __slots__ = ()

    @property
    def num_tokens(self) -> int:
        return 11  # its prompt and one output token


class _Skipper(Policy):
    name = "skipper"

    def plan(self, view):
        return Plan(skip={1})


def test_the_scheduler_leaves_skipped_decoders_out_of_the_pass():
    cfg = SchedulerConfig(classes=CLASSES, default_class=None)
    sched = Scheduler(
        cfg, _Skipper(), ManualClock(0.0), 64, max_model_len=1000, unloaded_tpot_ms=lambda: 10.0
    )
    reqs = [_Decoding(i, SLO(tpot_ms=30.0, cls="interactive"), 0.0) for i in (1, 2)]
    for r in reqs:
        sched.add(r)
    sched.begin_step()
    sched.admit()
    for r in reqs:
        r.num_cached = r.num_tokens - 1  # decoding: one new token to verify
    batch = sched.reserve(sched.plan(sched.view()), can_draft=True)
    assert [r.rid for r in batch.decode] == [2]


def test_a_lost_prompt_does_not_take_the_others_down_with_it():
    """A relaxed prompt that misses its TTFT however it is served goes after the
    others and does not make them urgent sooner; it still runs (firm, last)."""
    kw = dict(chunk=256, t_pass_ms=100.0, margin=0.15, defer_rank=1, no_ttft_ms=30000.0)
    lost = prompt(1, 4000, 29500.0)  # 16 passes left, 0.5 s to its deadline
    fine = prompt(2, 1000, 28000.0)  # before its latest start (29.44 s)
    split = composition.split_prefill([lost, fine], **kw)
    assert [r.rid for r in split.firm] == [1] and [r.rid for r in split.soft] == [2]
    # counted ahead of it, the lost prompt's 4000 tokens would make request 2 urgent
    assert composition.latest_start_ms(30000.0, 5000, 256, 100.0, 0.15) <= 28000.0
    # a strict prompt is never lost: it stays first in deadline order and counts ahead
    strict = prompt(3, 4000, 1900.0, ttft_ms=2000.0, rank=0)
    assert [r.rid for r in composition.split_prefill([strict, fine], **kw).firm] == [3, 2]
