"""The routers' choices on hand-built replica stats (no Ray, no simulation), and
``replica_stats`` read from a real scheduler and planner."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from adaserve.cluster.routing import (
    ClassHeadroom,
    ReplicaStats,
    RouteRequest,
    SloRouter,
    make_router,
    replica_stats,
    with_routed,
)

TARGETS = {"interactive": (30.0, 2000.0, 0), "chat": (50.0, 4000.0, 1), "batch": (150.0, 3e4, 2)}


def replica(rid, tpot=10.0, running=None, prefill=None, waiting=0, **kw):
    """A replica whose load model predicts ``tpot`` ms (every class alike, as
    ``replica_stats`` reports), with the given requests running and prefill queued."""
    running, prefill = running or {}, prefill or {}
    classes = tuple(
        ClassHeadroom(
            name=n,
            rank=rk,
            tpot_ms=t,
            ttft_ms=f,
            predicted_tpot_ms=tpot,
            running=running.get(n, 0),
            waiting=0,
            prefill_tokens=prefill.get(n, 0),
        )
        for n, (t, f, rk) in TARGETS.items()
    )
    return ReplicaStats(
        replica_id=rid,
        classes=classes,
        budget_tokens=64,
        spare_budget_tokens=0,
        running=sum(running.values()),
        waiting=waiting,
        waiting_prefill_tokens=sum(prefill.values()),
        kv_free_fraction=kw.pop("kv_free", 0.8),
        pass_ms=kw.pop("pass_ms", 20.0),
        at_s=kw.pop("at_s", 0.0),
        ms_per_token=0.2,
        tokens_per_pass=3.0,
        base_pass_ms=10.0,
        request_ms=1.0,
        gained_per_pass=1.0,
        **kw,
    )


def request(cls="interactive", prompt=200, out=150):
    t, f, rk = TARGETS[cls]
    return RouteRequest(cls, rk, t, f, prompt, out)


def test_strict_requests_keep_off_a_replica_whose_strict_class_is_near_its_target():
    near = replica("near", tpot=26.5, running={"interactive": 20})
    roomy = replica("roomy", tpot=18.0, running={"interactive": 10, "batch": 5})
    r = SloRouter()
    assert not r.outlook(request(), near).feasible  # 26.5 + 1 ms passes 30 * 0.9
    assert r.outlook(request(), roomy).feasible
    assert r.rank(request(), [near, roomy]) == ["roomy", "near"]
    assert r.rank(request(), [roomy, near]) == ["roomy", "near"]


def test_strict_requests_take_the_replica_with_the_most_strict_headroom():
    a = replica("a", tpot=22.0, running={"interactive": 8})
    b = replica("b", tpot=15.0, running={"interactive": 4})
    c = replica("c", tpot=19.0, running={"interactive": 6})
    assert make_router("slo").rank(request(), [a, b, c]) == ["b", "c", "a"]


def test_class_balance_spreads_strict_requests_on_their_own_and_relaxed_by_queue():
    """Two replicas whose load model predicts the same TPOT: "a" runs 4 strict requests,
    "b" 1 strict and 5 batch. A strict request goes to "b" (fewest strict requests:
    strict decoders are what each pass is sized for), though its queue is longer; a
    relaxed one goes to "a" (the shorter queue). By queue length or by slack alone the
    strict request would go to "a"."""
    a = replica("a", tpot=20.0, running={"interactive": 4})
    b = replica("b", tpot=20.0, running={"interactive": 1, "batch": 5})
    r = make_router("slo:balance=class")
    assert r.rank(request(), [a, b]) == ["b", "a"]
    assert r.rank(request(), [b, a]) == ["b", "a"]
    assert r.rank(request("batch"), [a, b]) == ["a", "b"]
    assert r.rank(request("chat"), [b, a]) == ["a", "b"]
    # the earlier rules send the strict request to "a"
    assert SloRouter(balance="slack").rank(request(), [a, b])[0] == "a"
    assert make_router("p2c").rank(request(), [a, b])[0] == "a"
    # ties on strict requests: the shorter queue; then the most slack
    c = replica("c", tpot=20.0, running={"interactive": 1, "batch": 2})
    d = replica("d", tpot=12.0, running={"interactive": 1, "batch": 2})
    assert r.rank(request(), [a, b, c]) == ["c", "b", "a"]
    assert r.rank(request(), [c, d]) == ["d", "c"]


def test_in_overload_the_default_router_balances_by_class_not_by_slack():
    """No replica keeps the interactive class within its aim (27 ms): "a" predicts less
    (40 ms) but runs 10 strict requests; "b" 45 ms with 2 strict and 10 batch. The
    slack says "a"; the default router sends the strict request to "b" (the fewest
    strict requests) and a relaxed one to "a" (the shorter queue). While a replica stays
    feasible, it comes first by slack whatever its strict requests."""
    a = replica("a", tpot=40.0, running={"interactive": 10})
    b = replica("b", tpot=45.0, running={"interactive": 2, "batch": 10})
    r = make_router("slo")
    assert not any(r.outlook(request(), s).feasible for s in (a, b))
    assert r.rank(request(), [a, b]) == ["b", "a"]
    assert r.rank(request("chat"), [b, a]) == ["a", "b"]
    assert SloRouter(balance="slack").rank(request(), [a, b]) == ["a", "b"]
    assert make_router("p2c").rank(request(), [a, b])[0] == "a"
    # a feasible replica first, by slack, though it runs the most strict requests
    ok = replica("ok", tpot=15.0, running={"interactive": 12})
    quiet = replica("quiet", tpot=18.0, running={"interactive": 3})
    assert r.outlook(request(), ok).feasible and r.outlook(request(), quiet).feasible
    assert r.rank(request(), [a, quiet, b, ok]) == ["ok", "quiet", "b", "a"]
    assert make_router("slo:balance=class").rank(request(), [a, quiet, b, ok])[0] == "b"
    # feasible replicas with the same slack: the class-aware balancing decides
    even = replica("even", tpot=20.0, running={"interactive": 4})
    mixed = replica("mixed", tpot=20.0, running={"interactive": 1, "batch": 5})
    assert r.outlook(request(), even).slack == r.outlook(request(), mixed).slack
    assert r.rank(request(), [even, mixed]) == ["mixed", "even"]
    assert r.rank(request("batch"), [mixed, even]) == ["even", "mixed"]


def test_class_balance_puts_a_replica_whose_kv_cannot_hold_the_request_last():
    full = replica("full", kv_free=0.01, kv_total_tokens=10000)
    busy = replica("busy", tpot=25.0, running={"interactive": 6}, kv_total_tokens=10000)
    assert make_router("slo").rank(request(prompt=400, out=400), [full, busy]) == ["busy", "full"]


def test_ranking_changes_nothing_until_the_caller_reports_where_it_went():
    a, b = replica("a"), replica("b")
    for mode in ("hybrid", "class", "slack"):
        r = SloRouter(balance=mode)
        for _ in range(20):
            r.rank(request("batch", prompt=4000), [a, b])
        assert r.prefill_share(a) == 0.0 == r.prefill_share(b)
        r.routed(request("batch", prompt=4000), b)
        assert r.prefill_share(b) > 0.0 == r.prefill_share(a)


def test_relaxed_work_packs_onto_the_feasible_replica_with_the_least_slack():
    busy = replica("busy", tpot=30.0, running={"batch": 8, "chat": 4})
    idle = replica("idle")
    full = replica("full", tpot=44.0, running={"chat": 30})  # chat at its 45 ms aim
    r = SloRouter(balance="slack", relaxed="pack")
    assert r.outlook(request("chat"), busy).slack < r.outlook(request("chat"), idle).slack
    assert not r.outlook(request("chat"), full).feasible
    assert r.rank(request("chat"), [idle, full, busy])[0] == "busy"
    # the strict request goes the other way: to the idle replica
    assert r.rank(request(), [idle, full, busy])[0] == "idle"
    # spread: relaxed work takes the most slack too
    assert (
        SloRouter(balance="slack", relaxed="spread").rank(request("chat"), [full, busy, idle])[0]
        == "idle"
    )


def test_relaxed_work_apart_goes_where_strict_work_is_not():
    strict = replica("strict", tpot=8.0, running={"interactive": 10})  # slack 0.67
    relaxed = replica("relaxed", tpot=60.0, running={"batch": 30})  # slack 0.55
    apart = SloRouter(balance="slack", relaxed="apart")
    assert apart.rank(request("batch"), [strict, relaxed])[0] == "relaxed"
    assert (
        SloRouter(balance="slack", relaxed="spread").rank(request("batch"), [strict, relaxed])[0]
        == "strict"
    )


@pytest.mark.parametrize("mode", ["apart", "pack", "spread"])
def test_relaxed_work_keeps_off_a_replica_it_would_push_strict_past_its_target(mode):
    # chat alone would fit (45 ms aim), but the interactive class there is at its aim
    tight = replica("tight", tpot=26.5, running={"interactive": 9, "chat": 3})
    loose = replica("loose", tpot=12.0, running={"interactive": 12})
    assert (
        SloRouter(balance="slack", relaxed=mode).rank(request("chat"), [tight, loose])[0] == "loose"
    )


def test_ttft_unreachable_behind_a_long_prefill_queue_is_infeasible():
    # 40 chunks of strict prefill ahead at ~62 ms a chunk pass: past the 2 s TTFT
    queued = replica("queued", prefill={"interactive": 40 * 256})
    free = replica("free", tpot=20.0, running={"interactive": 5})
    r = SloRouter(balance="slack")
    assert not r.outlook(request(), queued).feasible
    assert r.rank(request(), [queued, free])[0] == "free"
    # relaxed prefill queued there does not delay a strict request (it runs first)...
    relaxed_q = replica("relaxed_q", prefill={"batch": 40 * 256})
    assert r.outlook(request(), relaxed_q).feasible
    # ...and prefill of a stricter class delays a looser one's TTFT
    chat_q = replica("chat_q", prefill={"chat": 70 * 256})
    assert not r.outlook(request("chat"), chat_q).feasible
    assert r.outlook(request("chat"), relaxed_q).feasible


def test_the_prefill_the_router_sent_a_replica_keeps_strict_requests_off_it():
    """Two replicas alike; long prompts sent to one make its passes longer (prefill
    takes a share of its time), so the next strict request goes to the other."""
    a, b = replica("a", tpot=20.0), replica("b", tpot=20.0)
    r = SloRouter(balance="slack")
    big = request("batch", prompt=4000)
    assert r.rank(big, [a, b])[0] == "a"  # a tie: the first
    assert r.prefill_share(a) == 0.0  # ranking alone changes nothing...
    r.routed(big, a)  # ...the caller tells where it went
    assert r.prefill_share(a) > 0.0 == r.prefill_share(b)
    assert r.rank(request(), [a, b])[0] == "b"
    # the rate decays: long after, the replicas look alike again
    later = [replica("a", tpot=20.0, at_s=600.0), replica("b", tpot=20.0, at_s=600.0)]
    assert r.prefill_share(later[0]) < 1e-6


def test_when_no_replica_stays_feasible_the_one_with_the_most_slack_comes_first():
    a = replica("a", tpot=52.0, running={"interactive": 30})
    b = replica("b", tpot=46.0, running={"interactive": 30})
    c = replica("c", tpot=49.0, running={"interactive": 30})
    for r in [SloRouter()] + [
        SloRouter(balance="slack", relaxed=m) for m in ("apart", "pack", "spread")
    ]:
        for req in (request(), request("chat")):
            assert not any(r.outlook(req, s).feasible for s in (a, b, c))
        assert r.rank(request(), [a, b, c]) == ["b", "c", "a"]
        assert r.rank(request("chat"), [a, b, c]) == ["b", "c", "a"]


def test_kv_that_cannot_hold_the_request_makes_a_replica_infeasible():
    small = replica("small", kv_free=0.01, kv_total_tokens=10000)
    big = replica("big", tpot=25.0, kv_free=0.9, kv_total_tokens=10000)
    assert not SloRouter().outlook(request(prompt=400, out=400), small).feasible
    assert make_router("slo").rank(request("batch"), [small, big])[0] == "big"


def test_with_routed_counts_the_request_until_the_next_report():
    s = replica("a", tpot=20.0, running={"chat": 2})
    t = with_routed(s, request("chat", prompt=300, out=100))
    assert (t.waiting, t.waiting_prefill_tokens) == (1, 300)
    assert t.headroom("chat").waiting == 1 and t.headroom("chat").prefill_tokens == 300
    assert t.headroom("interactive").predicted_tpot_ms > 20.0
    assert t.decode_left == (100,)
    # the outlook's pass time: the replica's, plus what the request adds
    r = SloRouter()
    small, big = r.outlook(request(prompt=100), s), r.outlook(request(prompt=3000), s)
    assert s.pass_ms < small.pass_ms < big.pass_ms


def stats_q(rid, q):
    return replica(rid, running={"chat": q})


def test_p2c_puts_the_shorter_of_two_random_replicas_first_and_is_seeded():
    reps = [stats_q(f"r{i}", q) for i, q in enumerate((5, 1, 9, 3))]
    firsts = []
    for _ in range(400):
        order = make_router("p2c", seed=3).rank(request(), reps)
        assert sorted(order) == ["r0", "r1", "r2", "r3"]
    p = make_router("p2c", seed=3)
    firsts = [p.rank(request(), reps)[0] for _ in range(600)]
    # the longest queue never wins a pair; the shortest wins every pair it is drawn in (1/2)
    counts = Counter(firsts)
    assert "r2" not in counts
    assert 0.4 < counts["r1"] / 600 < 0.6
    assert {"r0", "r3"} <= set(counts)
    again = make_router("p2c", seed=3)
    assert [again.rank(request(), reps)[0] for _ in range(600)] == firsts
    other = make_router("p2c", seed=4)
    assert [other.rank(request(), reps)[0] for _ in range(600)] != firsts


def test_p2c_with_two_replicas_always_takes_the_shorter_queue():
    reps = [stats_q("a", 7), stats_q("b", 2)]
    p = make_router("p2c")
    assert all(p.rank(request(), reps) == ["b", "a"] for _ in range(50))
    assert p.rank(request(), reps[:1]) == ["a"] and p.rank(request(), []) == []


def test_round_robin_takes_replicas_in_turn_whatever_their_load():
    reps = [stats_q("a", 50), stats_q("b", 0), stats_q("c", 3)]
    rr = make_router("rr")
    assert [rr.rank(request(), reps)[0] for _ in range(7)] == list("abcabca")
    assert rr.rank(request(), reps) == ["b", "c", "a"]


@pytest.mark.parametrize(
    "spec, msg",
    [
        ("least-loaded", "unknown router 'least-loaded'; known: slo, p2c, rr"),
        ("", "unknown router"),
        ("p2c:margin=0.1", "unknown router option"),
        ("slo:margin=x", "must be a number"),
        ("slo:margin=1.5", "margin and pack_slack must be in [0, 1)"),
        ("slo:relaxed=nowhere", "relaxed must be apart, pack or spread"),
        ("slo:balance=queue", "balance must be hybrid, class or slack"),
        ("slo:relaxed=pack", "need balance=slack"),
        ("slo:depth=3", "unknown router option 'depth=3'"),
    ],
)
def test_a_bad_router_spec_is_a_clear_value_error(spec, msg):
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace(")", r"\)")):
        make_router(spec)


def test_bad_stats_are_refused():
    with pytest.raises(ValueError, match="kv_free_fraction"):
        replica("x", kv_free=1.5)
    with pytest.raises(ValueError, match="predicted_tpot_ms must be positive"):
        ClassHeadroom("c", 0, 30.0, 2000.0, 0.0, 0, 0)


def test_replica_stats_reads_a_real_scheduler_and_planner():
    """Load raises the predicted pass time and TPOT the stats report; counts, prefill
    and KV follow the scheduler."""
    from adaserve.bench.workload_spec import WorkItem
    from adaserve.core.clock import ManualClock
    from adaserve.core.scheduler import Scheduler
    from adaserve.policies.registry import make_policy
    from adaserve.sim import presets
    from adaserve.sim.loop import SimConfig, SimRequest

    hw = presets.deployment("A100-80GB:llama-70b").hardware_model()
    cfg = SimConfig(classes=presets.gpu_classes(), default_class=None)

    def loaded(n_decoding: int, n_waiting: int):
        policy = make_policy("adaserve")
        sched = Scheduler(
            cfg,
            policy,
            ManualClock(1.0),
            4096,
            max_model_len=1 << 20,
            unloaded_tpot_ms=hw.unloaded_tpot_ms,
            hw=hw,
        )
        reqs = []
        for i in range(n_decoding + n_waiting):
            cls = ("interactive", "chat")[i % 2]
            it = WorkItem(i, 0.0, cls, None, None, prompt_len=100, max_tokens=200)
            reqs.append(SimRequest(it, sched.class_slo(cls)))
        for r in reqs[:n_decoding]:
            sched.add(r)
        sched.begin_step()
        sched.admit()
        for r in reqs[:n_decoding]:  # prefilled, one token out
            r.num_cached = r.n_tokens
            r.n_tokens += 1
            r.first_token_at = 0.5
        for r in reqs[n_decoding:]:
            sched.add(r)
        sched.reserve(sched.plan(sched.view((0.7, 0.15, 0.07, 0.04))), can_draft=True)
        return replica_stats("r0", sched, policy, 1.0)

    light, heavy = loaded(2, 0), loaded(40, 3)
    assert (light.running, light.waiting, light.waiting_prefill_tokens) == (2, 0, 0)
    assert (heavy.running, heavy.waiting, heavy.waiting_prefill_tokens) == (40, 3, 300)
    assert heavy.pass_ms > light.pass_ms and heavy.kv_free_fraction < light.kv_free_fraction
    li, hi = light.headroom("interactive"), heavy.headroom("interactive")
    assert (li.running, hi.running) == (1, 20)
    assert hi.predicted_tpot_ms > li.predicted_tpot_ms
    assert light.spare_budget_tokens > heavy.spare_budget_tokens
    assert light.tokens_per_pass > 1.0  # the planner speculates
    assert math.isinf(light.headroom("batch").ttft_ms) is False
    r = SloRouter()
    assert r.rank(request(), [heavy, light])[0] == "r0" and r.outlook(request(), light).feasible
