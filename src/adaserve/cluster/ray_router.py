"""The Ray Serve ``RequestRouter`` of the engine deployment: Ray Serve's routing
machinery (queue-length probes, back-off, replica membership, fault handling) with the
decision delegated to ``adaserve.cluster.routing.make_router``.

Every replica reports its ``routing.ReplicaStats`` through ``record_routing_stats``;
Ray Serve hands them to the router as ``RunningReplica.routing_stats``. Between two
reports this router adds the requests it has chosen a replica for since that report
was taken (their prompts queue there), so that a burst does not all go to the replica that
looked emptiest a moment ago (``routing.with_routed``: what each such request adds, as
the routers' load model prices it). A replica without stats yet (just started) is taken as
idle. Requests that are not generations (``/v1/models``, ``/health``) and the
deployment's other methods go by queue length alone.

``request_router_kwargs``: ``{"router": "slo"|"p2c"|"rr", "seed": int,
"default_class": str}``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import deque

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from adaserve.cluster.routing import (
    ClassHeadroom,
    ReplicaStats,
    RouteRequest,
    make_router,
    with_routed,
)

_STATS_FIELDS = {f.name for f in dataclasses.fields(ReplicaStats)}
_CLASS_FIELDS = {f.name for f in dataclasses.fields(ClassHeadroom)}


def stats_of(replica_id: str, d: dict | None, now_s: float) -> ReplicaStats:
    """``ReplicaStats`` from a reported dict (an idle replica when there is none)."""
    if not d:
        return ReplicaStats(replica_id, (), 0, 0, 0, 0, 0, 1.0, 1.0, now_s)
    kw = {k: v for k, v in d.items() if k in _STATS_FIELDS}
    kw["classes"] = tuple(
        ClassHeadroom(**{k: v for k, v in c.items() if k in _CLASS_FIELDS})
        for c in d.get("classes", ())
    )
    kw["replica_id"] = replica_id
    return ReplicaStats(**kw)


def route_request(route: dict, stats: list[ReplicaStats], default_class: str) -> RouteRequest:
    """The router's view of a request from what the front door read of it; the class's
    rank and targets come from the replicas' reports (explicit targets win)."""
    cls = route.get("slo_class") or default_class
    head = None
    for s in stats:
        head = s.headroom(cls)
        if head is not None:
            break
    ranks = sorted({c.rank for s in stats for c in s.classes})
    rank = head.rank if head is not None else (ranks[-1] if ranks else 0)
    tpot = route.get("tpot_ms") or (head.tpot_ms if head is not None else math.inf)
    ttft = route.get("ttft_ms") or (head.ttft_ms if head is not None else math.inf)
    return RouteRequest(
        slo_class=cls,
        rank=int(rank),
        tpot_ms=float(tpot),
        ttft_ms=float(ttft),
        prompt_tokens=int(route.get("prompt_tokens") or 1),
        max_tokens=int(route.get("max_tokens") or 16),
    )


class AdaServeRequestRouter(RequestRouter):
    """See the module docstring."""

    def initialize_state(self, router: str = "slo", seed: int = 0, default_class: str = ""):  # type: ignore[override]  # Ray passes its own keywords
        self.policy = make_router(router, seed=seed)
        self.default_class = default_class
        # per replica: (time, route) of the requests sent there since its last report
        self._sent: dict[str, deque] = {}
        self._chosen: dict = {}  # request id -> the replica it was sent to
        self._entries: dict = {}  # request id -> its entry in ``_sent``
        self.decisions = 0

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        route = _route_of(pending_request)
        if route is None:  # not a generation: the least loaded (Ray's probes decide)
            return [candidate_replicas]
        now = time.time()
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        stats = [self._with_sent(rid, r.routing_stats, now) for rid, r in by_id.items()]
        req = route_request(route, stats, self.default_class)
        order = self.policy.rank(req, stats)
        home = route.get("replica")  # a retry's seat (``cluster.seat_routes``)
        if home is not None:
            order = home_first(order, home, self._fit(req, stats))
        self.decisions += 1
        ranked = [[by_id[rid]] for rid in order if rid in by_id]
        # Ray sends it to the first that accepts: almost always this one; the router's
        # own record of it is kept once a request
        if ranked and self._note_sent(pending_request, order[0], route, now):
            self.policy.routed(req, next(s for s in stats if s.replica_id == order[0]))
        return ranked

    def _note_sent(self, pending_request, rid: str, route: dict, now: float) -> bool:
        """Count the request as sent to ``rid``; True the first time it is chosen."""
        key = getattr(pending_request.metadata, "internal_request_id", None) or id(pending_request)
        prev = self._chosen.pop(key, None)
        if prev is not None:  # chosen again (the first choice refused it): move it
            q = self._sent.get(prev)
            if q is not None:
                with contextlib.suppress(ValueError):
                    q.remove(self._entries.pop(key))
        entry = (now, route)
        self._sent.setdefault(rid, deque(maxlen=4096)).append(entry)
        self._chosen[key] = rid
        self._entries[key] = entry
        if len(self._chosen) > 8192:  # forget the oldest
            old = next(iter(self._chosen))
            self._chosen.pop(old)
            self._entries.pop(old, None)
        return prev is None

    def _fit(self, req: RouteRequest, stats: list[ReplicaStats]) -> set[str] | None:
        """The replicas the router's load model finds feasible for ``req`` (None: a
        router without one, ``p2c`` and ``rr``)."""
        outlook = getattr(self.policy, "outlook", None)
        if outlook is None:
            return None
        return {o.replica_id for o in (outlook(req, s) for s in stats) if o.feasible}

    def _with_sent(self, rid: str, reported: dict | None, now: float) -> ReplicaStats:
        s = stats_of(rid, reported, now)
        q = self._sent.get(rid)
        while q and q[0][0] < s.at_s:  # already counted in the report
            q.popleft()
        for _, route in q or ():
            s = with_routed(s, route_request(route, [s], self.default_class))
        return s


def home_first(order: list[str], home: str | None, fit: set[str] | None = None) -> list[str]:
    """``order`` with ``home`` first: a retry goes back to the replica holding its seat
    (``cluster.seat_routes``), where its turn was kept, while it is a candidate, unless
    another replica can serve it within its targets now (``fit``, the feasible ones by
    the router's load model; None: not known) and home cannot. The ranking as it was
    otherwise."""
    if home is None or home not in order or (fit and home not in fit):
        return order
    return [home, *(r for r in order if r != home)]


def _route_of(pending_request: PendingRequest | None) -> dict | None:
    if pending_request is None or not pending_request.args:
        return None
    route = pending_request.args[0]
    return route if isinstance(route, dict) and route.get("generation") else None
