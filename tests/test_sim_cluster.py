"""The simulator at cluster scale (``sim/cluster.py``, ``simulate --replicas``): one
replica is the plain simulator, the run is deterministic, the routers route differently."""

from __future__ import annotations

import json

import pytest

from adaserve.bench.runner import class_slos
from adaserve.bench.workload_spec import WorkItem
from adaserve.cluster.routing import make_router
from adaserve.hardware.model import HardwareModel
from adaserve.policies.registry import make_policy
from adaserve.sim.acceptance import AcceptanceModel
from adaserve.sim.acceptance_params import AcceptanceParams
from adaserve.sim.cluster import run_cluster
from adaserve.sim.loop import SimConfig, Simulator

STATS = {
    "acceptance_by_rank": [0.7, 0.15, 0.05, 0.02, 0.01, 0.0, 0.0, 0.0],
    "acceptance_by_depth": [0.7, 0.5, 0.375, 0.3, 0.24, 0.19, 0.15, 0.12],
}
PROFILE = {
    "verify": {"tokens": [1, 64, 256, 1024], "latency_ms": [20.0, 24.0, 40.0, 110.0]},
    "draft_step_ms": 2.0,
}
CLASSES = ("interactive", "chat", "batch")


def _sim(seed: int = 0) -> Simulator:
    hw = HardwareModel.from_dict(PROFILE)
    acc = AcceptanceParams.from_stats_dict(STATS)
    return Simulator(hw, AcceptanceModel(acc), SimConfig(seed=seed, kv_slots=1 << 16))


def _items(n: int = 45, gap: float = 0.05):
    """A mixed workload: classes in turn, prompts and outputs of varied lengths."""
    return [
        WorkItem(i, i * gap, CLASSES[i % 3], None, None, 40 + (37 * i) % 300, 20 + (13 * i) % 60)
        for i in range(n)
    ]


def _slos(sim):
    return class_slos(list(CLASSES), 1.0, unloaded_tpot_ms=sim.unloaded_tpot_ms())


def _key(records):
    return [
        (r.idx, r.first_token_s, r.finish_s, r.output_tokens, r.accepted, r.attained)
        for r in records
    ]


def _cluster(n: int, router: str, items, seed: int = 0, interval: float = 0.1):
    sim = _sim(seed)
    return run_cluster(
        sim,
        [make_policy("adaserve") for _ in range(n)],
        make_router(router, seed=seed),
        items,
        _slos(sim),
        stats_interval_s=interval,
    )


@pytest.mark.parametrize("router", ["slo", "p2c", "rr"])
def test_one_replica_gives_the_plain_simulators_result(router):
    items = _items()
    sim = _sim(3)
    plain, tl = sim.run(make_policy("adaserve"), items, _slos(sim))
    recs, ctl = _cluster(1, router, items, seed=3)
    assert _key(recs) == _key(plain)
    assert ctl.info["iterations"] == tl.info["iterations"]
    assert ctl.info["duration_s"] == tl.info["duration_s"]
    assert ctl.info["requests_per_replica"] == [len(items)]


def test_the_cluster_run_is_deterministic_and_loses_no_request():
    items = _items(60, gap=0.02)
    a, ta = _cluster(3, "slo", items)
    b, tb = _cluster(3, "slo", items)
    assert _key(a) == _key(b)
    assert ta.info["requests_per_replica"] == tb.info["requests_per_replica"]
    assert sorted(r.idx for r in a) == [it.idx for it in items]
    assert all(r.completed for r in a)
    assert sum(ta.info["requests_per_replica"]) == len(items)


def test_routers_route_differently_and_replicas_share_the_load():
    items = _items(60, gap=0.02)
    runs = {r: _cluster(3, r, items) for r in ("slo", "p2c", "rr")}
    split = {r: tl.info["requests_per_replica"] for r, (_, tl) in runs.items()}
    assert split["rr"] == [20, 20, 20]
    # each router sends some requests elsewhere (the counts may still coincide: all
    # three balance this light load): the requests' timings differ
    assert len({tuple(_key(recs)) for recs, _ in runs.values()}) == 3
    for v in split.values():
        assert min(v) > 0  # every router uses every replica at this load
    # more replicas serve the same load faster: the cluster's TTFT beats one replica's
    one, _ = _cluster(1, "rr", items)
    three, _ = runs["rr"]
    mean = lambda rs: sum(r.first_token_s - r.arrival_s for r in rs) / len(rs)  # noqa: E731
    assert mean(three) < mean(one)


def test_the_router_is_told_where_each_request_went():
    """``run_cluster`` reports every placed request to ``Router.routed`` once, with the
    stats of the replica it went to."""

    class Spy:
        name = "spy"

        def __init__(self):
            self.inner, self.sent = make_router("slo"), []

        def rank(self, req, replicas):
            return self.inner.rank(req, replicas)

        def routed(self, req, s):
            self.sent.append(s.replica_id)
            self.inner.routed(req, s)

    items, sim, spy = _items(), _sim(0), Spy()
    run_cluster(sim, [make_policy("adaserve") for _ in range(3)], spy, items, _slos(sim))
    assert len(spy.sent) == len(items)
    counts = [spy.sent.count(str(k)) for k in range(3)]
    assert sum(counts) == len(items) and min(counts) > 0


def test_stale_stats_change_the_slo_routers_choices():
    items = _items(60, gap=0.02)
    fresh, tf = _cluster(3, "slo", items, interval=0.0)
    stale, ts = _cluster(3, "slo", items, interval=2.0)
    assert tf.info["requests_per_replica"] != ts.info["requests_per_replica"]


def _cli(args):
    from adaserve.cli import main

    return main(["simulate", *args, "--no-progress", "--no-plots"])


def test_simulate_compares_routers_side_by_side(tmp_path, capsys):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(PROFILE))
    out = tmp_path / "s"
    args = ["--profile", str(prof), "--accept", "0.7", "--duration", "2", "--dataset", "random"]
    args += ["--policies", "adaserve", "--replicas", "2", "--routers", "slo,p2c,rr"]
    args += ["--sweep", "rate", "--rates", "6,12", "--out", str(out)]
    assert _cli(args) == 0
    res = json.loads((out / "result.json").read_text())
    names = ["adaserve@slo", "adaserve@p2c", "adaserve@rr"]
    assert res["config"]["policies"] == names
    assert res["config"]["replicas"] == 2 and res["config"]["stats_interval_ms"] == 100.0
    for p in res["points"]:
        assert list(p["results"]) == names
        for r in p["results"].values():
            assert r["overall"]["replicas"] == 2
            assert sum(r["overall"]["requests_per_replica"]) == r["overall"]["requests"]
    assert set(res["capacity"]["policies"]) >= set(names)


@pytest.mark.parametrize(
    "extra, msg",
    [
        (["--replicas", "0"], "--replicas must be at least 1"),
        (["--replicas", "2", "--router", "fastest"], "unknown router 'fastest'"),
        (["--router", "slo"], "--router / --routers need --replicas N"),
        (["--replicas", "2", "--router", "slo", "--routers", "p2c"], "not both"),
        (["--replicas", "2", "--stats-interval-ms", "-1"], "--stats-interval-ms must be >= 0"),
    ],
)
def test_bad_cluster_options_are_one_line_errors(tmp_path, capsys, extra, msg):
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(PROFILE))
    rc = _cli(["--profile", str(prof), "--duration", "1", "--out", str(tmp_path / "o"), *extra])
    err = capsys.readouterr().err
    assert rc != 0 and msg in err and "Traceback" not in err
