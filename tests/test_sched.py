"""SLO-aware selection: budgets, connectivity, requirements, overload, calibration."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from conftest import random_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve import LLM, SLO, SamplingParams
from adaserve.core.clock import TickClock
from adaserve.core.policy import NO_BUDGET, BatchView, Plan, ReqView
from adaserve.core.tree import CandidateTree, is_connected
from adaserve.engine import Faults
from adaserve.hardware.calibration import Calibrator
from adaserve.hardware.model import HardwareModel
from adaserve.policies.budgeted import (
    DEPTHS,
    AdaptiveConfig,
    AdaServePolicy,
    BudgetedPolicy,
    DepthEvaluation,
    DynTreePolicy,
    make_adaptive,
)
from adaserve.policies.budgeted.columns import Columns
from adaserve.policies.budgeted.config import EXTRAS
from adaserve.policies.typical_tree import gain_curve

HW = HardwareModel.from_dict(
    {
        "verify": {"tokens": [1, 64, 256, 1024], "latency_ms": [10.0, 11.0, 14.0, 30.0]},
        "draft_step_ms": 0.2,
    }
)


def random_tree(rng, n_nodes: int) -> CandidateTree:
    parents = [0] + [int(rng.integers(0, i)) for i in range(1, n_nodes + 1)]
    depth = [0]
    for i in range(1, n_nodes + 1):
        depth.append(depth[parents[i]] + 1)
    q = np.concatenate(([1.0], rng.uniform(0.01, 1.0, n_nodes)))
    t = CandidateTree(
        tokens=rng.integers(0, 100, n_nodes + 1),
        parents=np.array(parents),
        depth=np.array(depth),
        q=q,
        rank=np.zeros(n_nodes + 1, dtype=np.int64),
        f=np.ones(n_nodes + 1),
    )
    Calibrator().apply(t)
    return t


def req(rid, tpot, behind_ms=0.0, n_out=10, rank=0) -> ReqView:
    # decode_ms chosen so the request is `behind_ms` behind its target
    decode = (n_out - 1) * tpot + behind_ms if tpot else 100.0
    return ReqView(
        rid=rid,
        cls="c",
        tpot_ms=tpot,
        ttft_ms=None,
        n_out=n_out,
        decode_ms=decode,
        waited_ms=decode,
        prefill_left=0,
        context_len=100,
        rank=rank,
    )


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 24),
    free=st.sampled_from([16, 64, 100_000]),
    max_budget=st.sampled_from([32, 128, 1024]),
)
def test_selection_respects_budgets_and_connectivity(seed, n, free, max_budget):
    rng = np.random.default_rng(seed)
    pol = AdaServePolicy()
    pol.cfg = type(pol.cfg)(max_budget=max(max_budget, n + 1))
    reqs = [
        req(i, float(rng.choice([5.0, 12.0, 60.0, 1e5])), float(rng.uniform(-50, 80)))
        for i in range(n)
    ]
    view = BatchView(now_ms=0.0, requests=reqs, free_kv_slots=free, hw=HW)
    plan = pol.plan(view)
    trees = {
        r.rid: random_tree(rng, int(rng.integers(1, 60))) for r in reqs if r.rid in plan.shapes
    }
    sel = pol.select(view, plan, trees)
    total = sum(len(s) - 1 for s in sel.values())
    assert total + n <= max(plan.budget, n)
    assert total <= free
    assert plan.budget <= pol.cfg.max_budget or not plan.shapes
    for rid, s in sel.items():
        assert s[0] == 0 and list(s) == sorted(set(s))
        assert is_connected(trees[rid].parents, s)
        assert len(s) - 1 <= plan.node_cap.get(rid, pol.cfg.node_cap)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 12))
def test_feasible_requirements_are_met(seed, n):
    """With ample budget, each request's expected accepted tokens reach A(r) - 1
    (the bonus token is certain) unless its tree cannot provide that much."""
    rng = np.random.default_rng(seed)
    pol = AdaServePolicy()
    reqs = [req(i, 12.0, float(rng.uniform(0, 40))) for i in range(n)]
    view = BatchView(now_ms=0.0, requests=reqs, free_kv_slots=10**6, hw=HW)
    plan = pol.plan(view)
    plan.budget = 10**6
    plan.shapes = {r.rid: (4, 2) for r in reqs}
    trees = {r.rid: random_tree(rng, int(rng.integers(5, 60))) for r in reqs}
    sel = pol.select(view, plan, trees)
    t_iter = plan.t_iter_ms
    for r in reqs:
        need = pol.requirement(r, t_iter) - 1.0
        f = trees[r.rid].f
        got = f[sel[r.rid][1:]].sum()
        best = np.sort(f[1:])[::-1][: pol.cfg.node_cap].sum()
        assert got >= min(need, best) - 1e-9


def test_infeasible_plan_takes_the_overload_path():
    pol = AdaServePolicy()
    pol.cfg = type(pol.cfg)(degrade=True, degrade_after=3)
    # hopelessly behind strict requests (need far more than any tree gives)
    reqs = [req(i, 1.0, behind_ms=500.0) for i in range(4)] + [req(9, 1e5)]
    view = BatchView(now_ms=0.0, requests=reqs, free_kv_slots=10**6, hw=HW)
    plans = [pol.plan(view) for _ in range(3)]
    assert set(plans[0].state.infeasible) == {0, 1, 2, 3}
    assert not plans[0].degrade
    assert set(plans[2].degrade) == {0, 1, 2, 3}
    # off by default: the requests are still reported infeasible, nobody is degraded
    pol = AdaServePolicy()
    plans = [pol.plan(view) for _ in range(20)]
    assert set(plans[-1].state.infeasible) == {0, 1, 2, 3}
    assert not any(p.degrade for p in plans)


def test_no_profile_falls_back_and_counts(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("ADASERVE_CACHE", str(tmp_path))
    target, draft, _ = tiny_pair
    prompts = random_prompts(6, seed=31)
    llm = LLM(
        model=str(target),
        draft=str(draft),
        policy="adaserve",
        auto_profile=False,
        kv_cache_bytes=16 << 20,
    )
    assert llm.engine.hw is None
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    assert llm.engine.counters.fallback_iterations.get("no_profile", 0) > 0
    assert llm.engine.counters.spec_draft_tokens == 0
    ref = LLM(model=str(target), no_draft=True, policy="ar").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=8)
    )
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_selection_uses_calibrated_acceptance():
    """Node A has the higher draft probability but its bucket is observed to be
    rejected; node B's bucket is observed to be accepted: with room for one node
    the policy must pick B."""
    cal = Calibrator()
    tree = CandidateTree(
        tokens=np.array([0, 1, 2]),
        parents=np.array([0, 0, 0]),
        depth=np.array([0, 1, 1]),
        q=np.array([1.0, 0.85, 0.45]),
        rank=np.array([0, 0, 1]),
        f=np.ones(3),
    )
    cal.apply(tree)
    assert tree.f[1] > tree.f[2]  # uncalibrated: f follows q
    for _ in range(200):
        cal.observe(tree.subtree(np.array([0, 1])), [])  # A tried, rejected
        cal.observe(tree.subtree(np.array([0, 2])), [1])  # B tried, accepted
    cal.apply(tree)
    assert tree.f[2] > 0.9 and tree.f[1] < 0.1
    pol = DynTreePolicy()
    view = BatchView(now_ms=0, requests=[req(0, None)], free_kv_slots=1000, hw=HW)
    plan = pol.plan(view)
    plan.budget = 2  # root + one candidate
    assert list(pol.select(view, plan, {0: tree})[0]) == [0, 2]


def test_plan_gives_behind_strict_requests_deeper_trees_than_relaxed_ones():
    """Same batch, same acceptance, verification flat up to 64 tokens and steep past
    them: the strict requests (on their 5 ms target's pace, so behind the aim the
    margin sets) get the deep trees that meet their requirements, the relaxed ones
    none, and every requirement is met."""
    hw = HardwareModel.from_dict(
        {
            "verify": {"tokens": [1, 64, 128, 256], "latency_ms": [10.0, 11.0, 30.0, 60.0]},
            "draft_step_ms": 0.3,
        }
    )
    reqs = []
    for i in range(16):
        strict = i % 2 == 0
        reqs.append(
            ReqView(
                rid=i,
                cls="c",
                tpot_ms=5.0 if strict else 1e5,
                ttft_ms=None,
                n_out=20,
                decode_ms=19 * (5.0 if strict else 10.0),
                waited_ms=0.0,
                prefill_left=0,
                context_len=200,
                rank=0 if strict else 2,
            )
        )
    view = BatchView(
        now_ms=0.0, requests=reqs, free_kv_slots=10**6, hw=hw, acc_by_rank=(0.8, 0.1, 0.05, 0.02)
    )
    plan = AdaServePolicy().plan(view)
    assert plan.state.choice.score == 8 * 3 + 8 * 1  # every requirement met (weights 3 and 1)
    depth = {rid: shape[0] for rid, shape in plan.shapes.items()}
    assert min(depth[i] for i in range(0, 16, 2)) > max(depth.get(i, 0) for i in range(1, 16, 2))
    alloc = plan.state.choice.alloc
    assert alloc[::2].min() > alloc[1::2].max()


def test_mixed_batch_end_to_end_per_request_trees_output_unchanged(tiny_pair, cheap_profile):
    """Through the engine: each request drafts the tree shape its plan gives it (here
    depth-4 chains for the strict half, none for the relaxed half, on top of what
    ``adaserve`` planned), and greedy output equals plain decoding, both under that and
    under ``adaserve`` as it plans (strict targets of 0.05 ms/token, behind on any
    machine). The draft is the target with noisy logits (acceptance around 0.3)."""
    target, _, _ = tiny_pair
    prompts = random_prompts(16, seed=32)
    slos = [
        SLO(tpot_ms=0.05, cls="interactive") if i % 2 == 0 else SLO(tpot_ms=1e6, cls="batch")
        for i in range(16)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = LLM(model=str(target), no_draft=True, policy="ar").generate(prompts, params)

    def spec_llm():
        llm = LLM(
            model=str(target),
            draft=str(target),
            policy="adaserve",
            profile=cheap_profile,
            kv_cache_bytes=32 << 20,
            clock=TickClock(0.001),
        )
        llm.engine.set_faults(Faults(draft_noise=0.5))
        return llm

    plain = spec_llm().generate(prompts, params, slo=slos)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in ref]
    assert sum(o.metrics["tree_nodes"] for o in plain) > 0  # it did speculate

    llm = spec_llm()
    planned = llm.engine.policy.plan

    def by_class(view):
        plan = planned(view)
        plan.budget = 1 << 20
        for r in view.decoding:
            if r.cls == "interactive":
                plan.shapes[r.rid], plan.node_cap[r.rid] = (4, 1), 4
            else:
                plan.shapes.pop(r.rid, None)
        return plan

    llm.engine.policy.plan = by_class
    outs = llm.generate(prompts, params, slo=slos)
    strict = [o.metrics["tree_nodes"] / o.metrics["steps"] for o in outs[::2]]
    relaxed = [o.metrics["tree_nodes"] for o in outs[1::2]]
    assert min(strict) > 1.0 and max(relaxed) == 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]


def test_strict_burst_does_not_starve_relaxed_request(tiny_pair, cheap_profile):
    """Decisions on a fake clock (1 ms a reading), never the machine's speed."""
    target, _, _ = tiny_pair
    clock = TickClock(0.001)
    llm = LLM(
        model=str(target),
        draft=str(target),
        policy="adaserve",
        profile=cheap_profile,
        max_num_seqs=2,
        kv_cache_bytes=16 << 20,
        clock=clock,
    )
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    strict = [
        eng.add_request(p, sp, SLO(tpot_ms=5.0, ttft_ms=100.0, cls="interactive"))
        for p in random_prompts(24, seed=33)
    ]
    clock.advance(0.01)
    relaxed = eng.add_request(
        [5, 6, 7], sp, SLO(tpot_ms=1e5, ttft_ms=1e6, max_queue_ms=30.0, cls="batch")
    )
    while not relaxed.finished:
        eng.step()
        if not relaxed.finished:
            # the burst keeps coming
            strict.append(
                eng.add_request([1, 2, 3], sp, SLO(tpot_ms=5.0, ttft_ms=100.0, cls="interactive"))
            )
    earlier = strict[:24]  # arrived before the relaxed request
    jumped = sum(1 for s in earlier if s.admitted_at is None or s.admitted_at > relaxed.admitted_at)
    assert jumped >= 12, "relaxed request past its max queue wait still waited behind the burst"


def test_selection_log_explains_decisions_without_text(tiny_pair, cheap_profile, tmp_path):
    target, _, _ = tiny_pair
    log = tmp_path / "sel.jsonl"
    prompts = random_prompts(4, seed=34)
    llm = LLM(
        model=str(target),
        draft=str(target),
        policy="adaserve",
        profile=cheap_profile,
        selection_log=str(log),
        kv_cache_bytes=16 << 20,
        clock=TickClock(0.001),
    )
    llm.generate(
        prompts,
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        slo=SLO(tpot_ms=8.0, cls="interactive"),
    )
    llm.engine.close()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines and all(
        {"request", "class", "requirement", "nodes", "expected_accepted", "accepted"} <= set(x)
        for x in lines
    )
    assert any(x["nodes"] > 0 for x in lines)
    rids = {str(o) for o in range(10)}
    assert not any(x["request"] in rids for x in lines)  # hashed, not raw ids
    assert all(len(json.dumps(x)) < 400 for x in lines)  # no prompt/output text


def _static_ms(tokens, steps, reqs):
    """A made-up profile: verification plus draft steps (ms)."""
    return 5.0 + 0.05 * tokens + 0.8 * steps + 0.1 * steps * reqs


def test_online_correction_learns_marginal_cost_of_tokens():
    """Iterations that cost 0.1 ms more per verified token than the profile says:
    the fitted correction recovers the slope, so bigger plans are priced higher."""
    from adaserve.policies.correction import OnlineCorrection

    corr = OnlineCorrection()
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens, steps, reqs = (
            int(rng.integers(1, 200)),
            int(rng.integers(0, 6)),
            int(rng.integers(1, 9)),
        )
        x = OnlineCorrection.features(_static_ms(tokens, steps, reqs), tokens, steps, reqs)
        corr.update(x, 2.0 + 0.1 * tokens + 0.05 * steps * reqs)
    small = corr.predict(OnlineCorrection.features(_static_ms(10, 2, 4), 10, 2, 4))
    big = corr.predict(OnlineCorrection.features(_static_ms(110, 2, 4), 110, 2, 4))
    assert abs((big - small) - 10.0) < 1.0


def test_online_correction_learns_a_slowdown_as_a_ratio():
    """The machine runs 1.4x slower than profiled and the policy only tried depths 2-3
    at 2-4 requests: a depth-8 plan is predicted 1.4x its profile, not priced out by a
    slope fitted on depth x requests (a chain's tokens are n x (1 + depth))."""
    from adaserve.policies.correction import OnlineCorrection

    corr = OnlineCorrection()
    rng = np.random.default_rng(1)
    for _ in range(200):
        n, d = int(rng.integers(2, 5)), int(rng.integers(2, 4))
        st = _static_ms(n * (1 + d), d, n)
        corr.update(OnlineCorrection.features(st, n * (1 + d), d, n), 0.4 * st)
    for n, d in ((3, 8), (1, 6), (6, 1)):
        st = _static_ms(n * (1 + d), d, n)
        got = float(corr.predict(OnlineCorrection.features(st, n * (1 + d), d, n)))
        assert got == pytest.approx(0.4 * st, rel=0.15)


def test_online_correction_puts_a_constant_gap_on_few_plans_modestly():
    """Every iteration 5 ms slower than profiled, at the few pass sizes a policy tries:
    the gap is not extrapolated as a steep per-token cost that would price big trees
    out (at most proportionally to the profile)."""
    from adaserve.policies.correction import OnlineCorrection

    corr = OnlineCorrection()
    for i in range(200):
        tok = 4 + i % 3
        corr.update(OnlineCorrection.features(_static_ms(tok, 1, 2), tok, 1, 2), 5.0)
    small = corr.predict(OnlineCorrection.features(_static_ms(5, 1, 2), 5, 1, 2))
    big = corr.predict(OnlineCorrection.features(_static_ms(40, 1, 2), 40, 1, 2))
    assert abs(small - 5.0) < 0.5
    ratio = _static_ms(40, 1, 2) / _static_ms(5, 1, 2)
    assert big - small < 5.0 * (ratio - 1) + 0.5


def _reference_depth(pol, view, reqs, d, w, P, kv, acc) -> dict:
    """The planner's prediction for one depth, written plainly per request: the
    reference for the vectorised program (BudgetedPolicy._evaluate_depths)."""
    c, hw = pol.cfg, view.hw
    n, strict = len(reqs), pol.name == "adaserve"
    g = gain_curve(d, w, acc)
    kmax = min(len(g) - 1, c.node_cap)
    kfill = sum(1 for k in range(kmax) if g[k + 1] > g[k])

    def t_iter(total):
        tok = n + P + total
        st = hw.verify_latency(tok, kv) + hw.drafting_ms(d, n * w, n + P, n) + hw.overhead_ms
        return max(st + pol.correction.residual(st, tok, d, n if d else 0), 0.5 * st)

    # the prefill chunk's part of t_iter (profile plus correction), left out of the rate
    th = pol.correction.theta
    t_pre = (hw.verify_latency(n + P, kv) - hw.verify_latency(n, kv)) * (1 + th[1]) + th[2] * P
    t_pre = max(0.0, t_pre) if P else 0.0

    def requirement(r, t):  # A(r), the module docstring's formula
        if r.tpot_ms is None:
            return 1.0
        aim = r.tpot_ms * (1 - c.slo_margin)
        h = min(max(r.max_tokens, 1), c.catch_up_tokens)
        slack = aim * (r.n_out + h - 1) - r.decode_ms
        need = h * t / slack if slack > 0 else math.inf
        return min(max(need, 1.0), c.max_depth + 1)

    alloc, t = [0] * n, t_iter(0)
    if strict:
        cap = max(0, min(view.free_kv_slots - n * w * d, c.max_budget - n - P))
        for _ in range(2):
            need = [requirement(r, t) - 1.0 for r in reqs]
            alloc = [min(int(np.sum(g < x - 1e-9)), kmax) for x in need]
            left = cap  # trim to the cap, the most behind first
            for i in sorted(range(n), key=lambda i: -need[i]):
                alloc[i] = min(alloc[i], left)
                left -= alloc[i]
            t = t_iter(sum(alloc))
    if pol.name == "smartspec":
        options = [[min(d, kmax)] * n]
    else:  # e more nodes, each to the request with the fewest (then the lowest index)
        options, a = [], list(alloc)
        for step in range(int(EXTRAS[-1]) + 1):
            if step in EXTRAS:
                options.append(list(a))
            open_ = [i for i in range(n) if a[i] < kfill]
            if open_:
                a[min(open_, key=lambda i: (a[i], i))] += 1
    best = None
    for e, a in enumerate(options):
        total = sum(a)
        ok = n + P + total <= c.max_budget and total + n * w * d <= view.free_kv_slots
        ok = ok or d == 0 or (e == 0 and pol.name != "smartspec")
        tt = t_iter(total)
        rate = (n + sum(g[k] for k in a)) / max(tt - t_pre, 0.1 * tt) if ok else -1.0
        if best is None or rate > best["rate"]:
            best = {"alloc": a, "budget": n + P + total, "t_iter": tt, "rate": rate}
    met_w = 0.0
    for r, k in zip(reqs, best["alloc"]):
        if r.tpot_ms is not None and requirement(r, best["t_iter"]) <= 1.0 + g[k] + 1e-9:
            met_w += 3 - min(r.rank, 2)
    best["score"] = met_w
    return best


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    n=st.integers(1, 40),
    free=st.sampled_from([24, 200, 100_000]),
    max_budget=st.sampled_from([48, 256, 1024]),
    name=st.sampled_from(["adaserve", "dyn-tree", "smartspec"]),
    w=st.sampled_from([1, 2, 4]),
    prefill=st.sampled_from([0, 100]),
)
def test_vectorised_depth_evaluation_equals_the_per_request_reference(
    seed, n, free, max_budget, name, w, prefill
):
    """The planner scores all depths of a width as one array program; it must give what
    the plain per-request reference gives (allocation, time, rate, SLO score)."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        tpot = float(rng.choice([8.0, 15.0, 40.0])) if rng.random() < 0.85 else None
        behind = float(rng.uniform(-30, 60))
        r = req(i, tpot, behind_ms=behind, n_out=int(rng.integers(1, 60)), rank=i % 3)
        reqs.append(dataclasses.replace(r, max_tokens=int(rng.integers(1, 40))))
    pol = make_adaptive(name)
    pol.cfg = dataclasses.replace(pol.cfg, max_budget=max_budget)
    pol.correction.theta = rng.normal(0, [1.0, 0.1, 0.01, 0.3, 0.02])
    view = BatchView(now_ms=0.0, requests=reqs, free_kv_slots=free, hw=HW)
    acc = tuple(round(float(x), 2) for x in np.sort(rng.uniform(0.02, 0.9, 4))[::-1])
    depths = (0, 1, 2, 3, 4, 5, 6, 8)
    fast = pol._evaluate_depths(view, Columns.of(reqs), depths, w, prefill, 5000.0, acc)
    for i, d in enumerate(depths):
        ref = _reference_depth(pol, view, reqs, d, w, prefill, 5000.0, acc)
        assert fast.alloc[i].tolist() == ref["alloc"], d
        assert fast.budget[i] == ref["budget"]
        assert fast.t_iter[i] == pytest.approx(ref["t_iter"], rel=1e-12)
        assert fast.rate[i] == pytest.approx(ref["rate"], rel=1e-12)
        if name == "adaserve":
            assert fast.met_w[i] == pytest.approx(ref["score"], rel=1e-9, abs=1e-12)


def test_adaserve_takes_the_cheapest_shape_within_the_rate_tolerance(monkeypatch):
    """Shape choice: most requirements met first; among those, every shape within
    ``rate_tolerance`` of the best predicted rate ties and the shallowest, then the
    narrowest, wins. dyn-tree takes the highest rate."""
    ds = (0, 1, 2, 3)
    table = {  # width -> (met_w, rate) per depth
        1: ([5.0, 7.0, 7.0, 7.0], [1.00, 1.40, 1.60, 1.64]),
        2: ([5.0, 7.0, 7.0, 6.0], [1.00, 1.55, 1.62, 1.90]),
    }

    def fake(self, view, arr, ds_, w, P, kv, acc, pairs=0.0):
        met, rate = table[w]
        D, n = len(ds_), len(arr.rid)
        return DepthEvaluation(
            met_w=np.array(met),
            rate=np.array(rate),
            budget=np.arange(D) + n,
            static=np.ones(D),
            t_iter=np.ones(D),
            alloc=np.zeros((D, n), dtype=np.int64),
            need=np.ones((D, n)),
        )

    monkeypatch.setattr(BudgetedPolicy, "_evaluate_depths", fake)
    reqs = [req(0, 15.0), req(1, 40.0)]
    view = BatchView(now_ms=0.0, requests=reqs, free_kv_slots=10_000, hw=HW)
    arr = Columns.of(reqs)

    def shape(name, tol):
        pol = make_adaptive(name, rate_tolerance=tol)
        best = pol._best_shape(view, arr, ds, (1, 2), 0, 0.0, (0.6, 0.3))
        return best.depth, best.width, best.rate

    # the 1.90 shape meets fewer requirements; best of the rest: 1.64 (depth 3, width 1)
    assert shape("adaserve", 0.0) == (3, 1, 1.64)
    assert shape("adaserve", 0.03) == (2, 1, 1.60)  # floor 1.591: depth 2, narrowest
    assert shape("adaserve", 0.1) == (1, 2, 1.55)  # floor 1.476: only width 2 at depth 1
    assert shape("dyn-tree", 0.1) == (3, 2, 1.90)
    with pytest.raises(ValueError, match="rate_tolerance"):
        AdaptiveConfig(rate_tolerance=1.0)


def test_a_prefill_chunk_does_not_deepen_the_trees():
    """The prefill chunk's time is spent whatever the trees: the planner rates shapes by
    decode tokens per ms beyond it, so the batch gets the tree it would get without the
    chunk (rated within the chunk's iteration, every extra draft step looks cheap and
    the deepest tree wins)."""
    hw = HardwareModel.from_dict(
        {
            "verify": {
                "tokens": [1, 16, 64, 256, 512],
                "latency_ms": [8.0, 10.0, 16.0, 45.0, 90.0],
            },
            "draft_step_ms": 1.0,
        }
    )
    reqs = [req(i, 1e5) for i in range(4)]
    view = BatchView(now_ms=0.0, requests=reqs, free_kv_slots=10**6, hw=hw)
    pol = AdaServePolicy()
    acc = (0.75, 0.1, 0.05, 0.02)
    shapes = {
        P: pol._best_shape(view, Columns.of(reqs), DEPTHS, (1,), P, 800.0, acc)
        for P in (0, 64, 256)
    }
    assert 1 <= shapes[0].depth < max(DEPTHS)
    assert max(b.depth for b in shapes.values()) == shapes[0].depth
    assert shapes[256].t_iter > shapes[0].t_iter + 30  # the chunk's time is paid


def test_policy_names_take_config_overrides_and_reject_bad_ones():
    from adaserve.errors import InvalidRequestError
    from adaserve.policies.registry import make_policy

    p = make_policy("adaserve:slo_margin=0.1:max_depth=6:catch_up_tokens=0")
    assert (p.name, p.cfg.slo_margin, p.cfg.max_depth, p.cfg.catch_up_tokens) == (
        "adaserve",
        0.1,
        6,
        0,
    )
    assert make_policy("dyn-tree:max_width=2").cfg.max_width == 2
    for bad, why in [
        ("adaserve:nope=1", "KEY=VALUE"),
        ("adaserve:max_depth", "KEY=VALUE"),
        ("adaserve:max_depth=deep", "takes a int"),
        ("adaserve:slo_margin=0.95", "slo_margin must be"),
        ("spec-chain:x", "unknown or malformed"),
    ]:
        with pytest.raises(InvalidRequestError, match=why):
            make_policy(bad)


@pytest.mark.parametrize("name", ["adaserve", "dyn-tree"])
def test_selection_takes_every_node_when_all_fit_and_one_fewer_at_the_edge(name):
    rng = np.random.default_rng(7)
    reqs = [req(i, 12.0, behind_ms=float(rng.uniform(-20, 40))) for i in range(5)]
    trees = {r.rid: random_tree(rng, int(rng.integers(2, 12))) for r in reqs}
    total = sum(t.num_candidates for t in trees.values())
    view = BatchView(now_ms=0.0, requests=reqs, free_kv_slots=10**6, hw=HW)
    pol = make_adaptive(name)
    plan = pol.plan(view)
    for budget, want in (
        (10**6, total),
        (len(reqs) + total, total),
        (len(reqs) + total - 1, total - 1),
    ):
        plan.budget = budget
        sel = pol.select(view, plan, trees)
        assert sum(len(s) - 1 for s in sel.values()) == want
        for rid, s in sel.items():
            assert is_connected(trees[rid].parents, s)
            if want == total:
                assert s.tolist() == list(range(trees[rid].num_candidates + 1))


def test_compiled_loops_fall_back_to_per_process_compilation(monkeypatch):
    """Where numba finds no writable cache location it refuses ``cache=True`` at
    decoration; ``adaserve.util.jit.compiled`` then compiles without a disk cache instead
    of failing the import of the planner and the simulator."""
    import numba

    from adaserve.util import jit

    def njit(*args, **kwargs):
        if kwargs.get("cache"):

            def refuse(fn):
                raise RuntimeError(f"cannot cache function {fn.__name__!r}: no locator available")

            return refuse
        return numba.njit(*args, **kwargs)

    monkeypatch.setattr(jit, "njit", njit)

    def add(a, b):
        return a + b

    fast = jit.compiled(add)
    assert fast(np.arange(3), 1).tolist() == [1, 2, 3]
    assert isinstance(fast, numba.core.registry.CPUDispatcher)


def test_plan_budget_and_policy_explain():
    """``NO_BUDGET`` reads as no budget; a plan carries its predicted iteration time;
    ``explain`` gives the selection log's requirement (None
    for the baselines and for plans that predict no time)."""
    from adaserve.policies.registry import make_policy

    assert Plan().budget == NO_BUDGET and Plan().bounded_budget is None
    assert Plan(budget=12).bounded_budget == 12
    r = req(0, 12.0, behind_ms=20.0)
    view = BatchView(now_ms=0.0, requests=[r], free_kv_slots=10**6, hw=HW)
    for name, cls in (("adaserve", "AdaServePolicy"), ("dyn-tree", "DynTreePolicy")):
        pol = make_policy(name)
        assert type(pol).__name__ == cls and pol.name == name
        plan = pol.plan(view)
        assert plan.t_iter_ms > 0
        want = round(pol.requirement(r, plan.t_iter_ms), 3)
        assert pol.explain(r, plan) == {"requirement": want} and want > 1.0
        assert pol.explain(r, Plan()) == {"requirement": None}
    assert type(make_policy("smartspec")).__name__ == "SmartSpecPolicy"
    for name in ("ar", "spec-chain:4", "spec-tree"):
        pol = make_policy(name)
        assert pol.explain(r, pol.plan(view)) == {"requirement": None}
        assert pol.plan(view).t_iter_ms is None


def test_budgeted_policy_keeps_its_planner_state_on_the_plan():
    """``feedback`` fits the correction from the plan's own state only: a plan without
    one (another policy's, or a fallback) teaches nothing."""
    pol = AdaServePolicy()
    view = BatchView(
        now_ms=0.0, requests=[req(i, 12.0) for i in range(3)], free_kv_slots=10**6, hw=HW
    )
    pol.feedback(Plan(t_iter_ms=5.0), 50.0)
    assert not pol.correction.theta.any()
    plan = pol.plan(view)
    pol.feedback(plan, plan.state.choice.t_static + 5.0)
    assert pol.correction.theta.any()
    with pytest.raises(dataclasses.FrozenInstanceError):
        pol.cfg.max_depth = 3
    with pytest.raises(ValueError, match="degrade_after"):
        AdaptiveConfig(degrade_after=0)


def test_the_planner_prices_grammar_masks_of_constrained_requests():
    """The same batch, its requests under a grammar: a costly mask per node makes the
    planner verify fewer tokens (each costs a mask); a free one changes nothing, and
    unconstrained requests never pay for it."""
    import dataclasses

    reqs = [req(i, 40.0, 0.0) for i in range(8)]
    cons = [dataclasses.replace(r, constrained=True) for r in reqs]

    def budget(rs, mask_ms):
        view = BatchView(
            now_ms=0.0, requests=rs, free_kv_slots=10**6, hw=HW, mask_ms_per_node=mask_ms
        )
        plan = AdaServePolicy().plan(view)
        return sum(max(0, d) * w for d, w in plan.shapes.values()), plan.budget

    free = budget(cons, 0.0)
    assert budget(reqs, 0.0) == free
    assert budget(reqs, 2.0) == free  # nobody is constrained
    priced = budget(cons, 2.0)
    assert priced[1] < free[1] or priced[0] < free[0], (priced, free)
