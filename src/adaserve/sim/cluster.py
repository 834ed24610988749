"""The simulator at cluster scale: N simulated replicas behind one router.

Each replica is one simulated engine (``sim.loop._Run``: the engine's ``Scheduler``
and its own instance of the policy, the synthetic drafting and pricing), all on one
simulated clock and fed by one arrival stream. Each arriving request is routed by
``cluster.routing`` (the router code the Ray Serve deployment runs) from every
replica's ``replica_stats``:

* the stats a router sees are refreshed every ``stats_interval_s`` of simulated time
  (0: taken at each arrival), modelling the replicas' reporting lag; between two
  refreshes the router adds what it has itself sent to each replica
  (``routing.with_routed``), as a real router counts its requests in flight;
* the request goes to the first replica of the router's ranking that admits it (a
  replica sheds only with ``--admission``); shed everywhere, it fails as shed. The
  router is told where it went (``Router.routed``; ranking alone changes nothing).

Events run in time order: an arrival at or before a replica's next pass start joins
before that pass (as in the single replica's loop), so one replica with any router
gives the single-replica simulator's result for the same seed. Replica 0 draws the
single replica's random streams, replica k its own (``_Run(stream=k)``).

The result has the single simulator's shape: the requests' records of every replica
and one timeline (shared recorder and counters: iterations, energy and sheds summed
over replicas; ``info["replicas"]`` and per-replica request counts added).
"""

from __future__ import annotations

import heapq
import time

from adaserve.bench.metrics import RequestRecord
from adaserve.bench.workload_spec import WorkItem, item_slo
from adaserve.cluster.routing import Router, RouteRequest, replica_stats, with_routed
from adaserve.core.counters import Counters
from adaserve.core.policy import Policy
from adaserve.core.slo import SLO
from adaserve.core.trace import RunTimeline
from adaserve.errors import AdaServeError, AdmissionRejected
from adaserve.sim.loop import Simulator, _Run, run_recorder


def route_request(it: WorkItem, slo: SLO, rank: int) -> RouteRequest:
    """What the router knows of ``it`` (no target: infinite)."""
    inf = float("inf")
    return RouteRequest(
        slo_class=it.cls,
        rank=rank,
        tpot_ms=float(slo.tpot_ms) if slo.tpot_ms else inf,
        ttft_ms=float(slo.ttft_ms) if slo.ttft_ms else inf,
        prompt_tokens=int(it.prompt_len),
        max_tokens=int(it.max_tokens),
    )


def run_cluster(
    sim: Simulator,
    policies: list[Policy],
    router: Router,
    items: list[WorkItem],
    slos: dict[str, SLO],
    *,
    policy_name: str | None = None,
    stats_interval_s: float = 0.1,
    kv_pressure: list[tuple[float, float]] | None = None,
) -> tuple[list[RequestRecord], RunTimeline]:
    """Simulate ``items`` on ``len(policies)`` replicas (one policy instance each)
    behind ``router``; returns the records of all requests and one timeline."""
    if not policies:
        raise ValueError("a cluster needs at least one replica")
    if not stats_interval_s >= 0:
        raise ValueError("stats_interval_s must be >= 0")
    wall0 = time.perf_counter()
    items = sorted(items, key=lambda it: (it.arrival_s, it.idx))
    horizon = items[-1].arrival_s if items else 0.0
    recorder, counters = run_recorder(sim, horizon), Counters()
    name = policy_name or policies[0].name
    reps = [
        _Run(
            sim,
            pol,
            [],
            slos,
            name,
            list(kv_pressure or []),
            False,
            stream=k,
            recorder=recorder,
            counters=counters,
        )
        for k, pol in enumerate(policies)
    ]
    ids = [str(k) for k in range(len(reps))]
    ranks = {c.name: c.rank for c in sim.cfg.classes}
    records: list[RequestRecord] = []
    routed = [0] * len(reps)
    stats = None
    stats_at = -1.0
    # replicas with work, by the time their next pass starts (ties: replica order)
    ready: list[tuple[float, int]] = []
    busy = [False] * len(reps)
    i, n = 0, len(items)
    while True:
        t_next = ready[0][0] if ready else float("inf")
        if i < n and items[i].arrival_s <= t_next:
            it = items[i]
            i += 1
            t = it.arrival_s
            if stats is None or stats_interval_s == 0 or t - stats_at >= stats_interval_s:
                stats = [replica_stats(ids[k], r.sched, r.policy, t) for k, r in enumerate(reps)]
                stats_at = t
            slo = item_slo(it, slos.get(it.cls))
            req = route_request(it, slo, ranks.get(it.cls, 0))
            err, shed = "shed: no replica admitted it", True
            for rid in router.rank(req, stats):
                k = int(rid)
                try:
                    reps[k].offer(it, slo)
                except AdmissionRejected as e:
                    err = f"shed: {e.reason}"
                    continue
                except AdaServeError as e:
                    err, shed = str(e), False
                    break
                router.routed(req, stats[k])  # the router's own record of where it went
                stats[k] = with_routed(stats[k], req)
                routed[k] += 1
                if not busy[k]:
                    busy[k] = True
                    reps[k].now = max(reps[k].now, t)
                    heapq.heappush(ready, (reps[k].now, k))
                break
            else:
                records.append(RequestRecord.failed(it, slo, err, shed))
                continue
            if err and not shed:
                records.append(RequestRecord.failed(it, slo, err, False))
            continue
        if not ready:
            break
        _, k = heapq.heappop(ready)
        rep = reps[k]
        rep.apply_kv_pressure()
        rep._step()
        if rep.sched.has_work():
            heapq.heappush(ready, (rep.now, k))
        else:
            busy[k] = False
    for rep in reps:
        records.extend(rep.records)
    records.sort(key=lambda r: r.idx)
    tl = recorder.timeline
    tl.info = _info(sim, reps, recorder, counters, records, slos, name, routed)
    tl.info["sim_wall_s"] = time.perf_counter() - wall0
    tl.info["router"] = router.name
    tl.info["stats_interval_s"] = stats_interval_s
    return records, tl


def _info(sim, reps, recorder, counters, records, slos, name, routed) -> dict:
    """The single simulator's run facts, summed over the replicas."""
    finish = [r.finish_s for r in records if r.finish_s is not None]
    duration = max(finish) if finish else max(max(r.now for r in reps), 1e-9)
    kvb = sim.hw.kv_bytes_target + sim.hw.kv_bytes_draft
    pool = sum(r.sched.allocator.num_blocks for r in reps) * sim.cfg.block_size * kvb
    busy = sum(r.busy_s for r in reps)
    sel = sum(r.sel_s for r in reps)
    return {
        **recorder.info(name, counters, pool, slos),
        "duration_s": duration if duration > 0 else 1e-9,
        "wall_s": duration,
        "model_time_s": busy,
        "step_time_s": busy,
        "shifts_applied": [],
        "unloaded_tpot_ms": sim.unloaded_tpot_ms(),
        "simulated": True,
        "selection_time_s": sel,
        "selection_share": sel / busy if busy > 0 else None,
        "selection_time_mode": sim.cfg.selection_time,
        "replicas": len(reps),
        "requests_per_replica": list(routed),
    }
