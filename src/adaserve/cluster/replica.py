"""One engine replica of a Ray Serve deployment: the single server's app, whole.

Each replica builds the engine thread (``EngineLoop``) and the same FastAPI app as
``adaserve serve`` (``server.app.create_app``): endpoints, validation, SLO resolution,
streaming and errors are that code, not a copy. The front door hands it each HTTP
request as plain data (``http``) and gets back ``("accepted",)``, then the ASGI
messages the app sends, as a stream (``("start", status, headers)`` then
``("body", bytes, more, tokens)``, ``tokens`` the request's output tokens handed to
the app so far, and once its engine requests exist ``("acct", {...})``: the tenant,
class, price and prompt tokens, so that the front door can count what it had relayed
if this replica dies mid-stream; ``relay``); a cancelled
stream (the client left) is an ``http.disconnect`` to the app, which aborts the
engine request.

Shared with the other replicas through the ``Ledger`` actor: quotas (``SharedQuotaBook``),
and, pushed a few times a second by a sync thread, this replica's Prometheus text, its
new finished-request records, new iteration samples and counts (for ``/metrics``,
``/v1/slo/report`` and the dashboard of the whole service). Ray Serve reads
``record_routing_stats`` (the planner's headroom, ``routing.replica_stats``) for the
SLO-aware router.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import os
import threading
import time
from typing import Any

from adaserve.cluster.seat_routes import REPLICA_HEADER
from adaserve.config import EngineConfig
from adaserve.server.config import ServerConfig

log = logging.getLogger("adaserve.cluster")

# the engine handles of the request an app task serves (``relay`` sets it, ``count_handles``'
# ``submit`` appends to it)
_HANDLES: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "adaserve_request_handles", default=None
)


def count_handles(eloop) -> None:
    """Have ``eloop.submit`` list each handle in the ``_HANDLES`` of the request whose
    app task submits it (the app calls ``state.loop.submit``: this instance's)."""
    submit = eloop.submit

    async def submit_listed(h):
        handles = _HANDLES.get()
        if handles is not None:
            handles.append(h)
        return await submit(h)

    eloop.submit = submit_listed


def bind_serve_grpc_to_loopback() -> bool:
    """On a loopback node (the local cluster of ``serve_app.init_local_ray``), have
    this replica's inter-deployment gRPC server listen on 127.0.0.1: Ray Serve 2.60
    binds it to ``[::]:0`` (every interface) whatever the node's address, with no
    option to change it (``ray.serve._private.replica``, ``_on_initialized``, which runs
    after this replica's constructor). True if done."""
    import ray
    from ray.serve._private import replica as serve_replica

    add = getattr(serve_replica, "add_port_to_grpc_server", None)
    if add is None or getattr(add, "adaserve_loopback", False):
        return add is not None
    if ray.util.get_node_ip_address() != "127.0.0.1":
        return False

    def add_on_loopback(server, address: str):
        if address.startswith("[::]:"):
            address = "127.0.0.1:" + address[len("[::]:") :]
        return add(server, address)

    add_on_loopback.adaserve_loopback = True  # type: ignore[attr-defined]  # a marker on the function
    serve_replica.add_port_to_grpc_server = add_on_loopback
    return True


def _acct(handles: list, replica_id: str) -> dict:
    ctx = handles[0].ctx
    acc = getattr(ctx, "acc", None)  # the request's usage ledger row (``RowAcc``)
    return {
        "id": getattr(acc, "id", None),
        "key_id": getattr(acc, "key_id", None),
        "class_asked": getattr(acc, "class_asked", None),
        "arrival": time.time(),
        "replica": replica_id,
        "tenant": getattr(ctx, "tenant", None),
        "cls": getattr(ctx, "cls", None),
        "price_per_1k": getattr(ctx, "price_per_1k", 0.0),
        "prompt_tokens": sum(
            len(h.prompt_ids) for h in handles if getattr(h.ctx, "count_prompt", True)
        ),
    }


def _output_tokens(handles: list) -> int:
    """Output tokens handed to the app so far (a score-only request's are not output)."""
    return sum(h.sent for h in handles if not h.drop_output)


async def relay(app, req: dict, replica_id: str):
    """``call_app``'s messages with the accounting the front door reads: ``("acct",
    {...})`` as soon as the request's engine handles exist, and each body item
    ``("body", bytes, more, tokens)`` (``tokens``: the output tokens handed to the app
    by the time it was sent)."""
    from adaserve.cluster.asgi import call_app

    handles: list = []
    ctx = contextvars.copy_context()
    ctx.run(_HANDLES.set, handles)
    told = False
    async for msg in call_app(app, req, {REPLICA_HEADER: replica_id}, context=ctx):
        items = list(msg[1]) if msg[0] == "many" else [msg]
        out = []
        if handles and not told and handles[0].ctx is not None:
            told = True
            out.append(("acct", _acct(handles, replica_id)))
        n = _output_tokens(handles)
        out.extend((*m, n) if m[0] == "body" else m for m in items)
        yield out[0] if len(out) == 1 else ("many", out)


class EngineReplica:
    """The body of the Ray Serve deployment (``serve_app`` wraps it)."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits an async __init__
        self,
        ecfg: EngineConfig,
        cfg: ServerConfig,
        ledger_name: str,
        namespace: str | None,
        push_period_s: float = 0.25,
    ):
        import ray
        from ray import serve

        from adaserve.cluster.shared_quotas import SharedQuotaBook
        from adaserve.server.app import create_app
        from adaserve.server.engine_loop import EngineLoop

        bind_serve_grpc_to_loopback()
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        if cfg.usage.replica is None:  # the usage ledger's rows name the replica
            cfg = dataclasses.replace(
                cfg, usage=dataclasses.replace(cfg.usage, replica=self.replica_id)
            )
        self.eloop = EngineLoop.for_server(ecfg, cfg)
        count_handles(self.eloop)
        self.app = create_app(self.eloop, cfg)
        self.state = self.app.state.adaserve
        # the app's own start-up, as uvicorn runs it for a single server (the engine
        # thread, the checks against the classes, the body limit, the stats log line)
        self._lifespan: contextlib.AbstractAsyncContextManager[Any] | None = (
            self.app.router.lifespan_context(self.app)
        )
        await self._lifespan.__aenter__()
        self.ledger = ray.get_actor(ledger_name, namespace=namespace)
        await self._deployment_targets()
        self.quotas = SharedQuotaBook(self.ledger, self.replica_id)
        self.state.quotas = self.quotas
        self._outbox: list = []
        self._outbox_lock = threading.Lock()
        self._samples_seen = 0  # of the iteration log's samples, those pushed
        self.state.report.on_record = self._on_record
        self._stop = threading.Event()
        self._period = push_period_s
        self._drain_seen = False
        self._sync = threading.Thread(target=self._sync_loop, name="adaserve-sync", daemon=True)
        self._sync.start()
        log.info("replica %s serving (pid %d)", self.replica_id, os.getpid())

    async def _deployment_targets(self) -> None:
        """Judge by the deployment's class targets (``cluster.targets``): offer this
        replica's own record to the ledger, adopt the one it keeps."""
        from adaserve.cluster.targets import adopt, own_record

        own = await asyncio.wrap_future(self.eloop.call(own_record))
        rec = await self.ledger.targets.remote(self.replica_id, own)
        if rec is not None and rec.get("replica") != self.replica_id:

            def go(e):
                changed = adopt(e, rec)
                if changed:
                    self.eloop.refresh_class_slos()
                return changed

            await asyncio.wrap_future(self.eloop.call(go))

    # ------------------------------------------------------------------ requests
    async def http(self, route: dict, req: dict):
        """Run one HTTP request through the app; yields its response as messages."""
        yield ("accepted",)  # from here on a failure is one in flight, not retried
        async for msg in relay(self.app, req, self.replica_id):
            yield msg

    async def info(self) -> dict:
        """Who this replica is and how busy (tests and operators)."""
        snap = self.eloop.snapshot
        return {
            "replica_id": self.replica_id,
            "pid": os.getpid(),
            "running": snap.running,
            "waiting": snap.waiting,
            "kv_usage": snap.kv_usage,
            "in_flight": self.eloop.in_flight,
        }

    async def record_routing_stats(self) -> dict:
        """Ray Serve's hook (every ``request_routing_stats_period_s``): the planner's
        headroom as a dict of ``routing.ReplicaStats``."""
        from adaserve.cluster.routing import replica_stats

        rid = self.replica_id

        def stats(engine):
            s = replica_stats(rid, engine.scheduler, engine.policy, time.time())
            return dataclasses.asdict(s)

        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.eloop.call(stats)), 5.0)
        except Exception:  # no stats this round: the router falls back to queue lengths
            log.exception("routing stats failed")
            return {}

    async def check_health(self) -> None:
        """Ray Serve's health check: the engine thread must be alive."""
        if not self.eloop.alive:
            raise RuntimeError("the engine thread is down")

    async def __del__(self) -> None:
        # Ray Serve calls (and awaits) this after the replica's requests have drained,
        # or its graceful shutdown timeout has passed: the app's shutdown cancels what
        # is left and ends the engine thread
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        lifespan, self._lifespan = getattr(self, "_lifespan", None), None
        if lifespan is not None:
            await lifespan.__aexit__(None, None, None)

    # ------------------------------------------------------------------ sync thread
    def _on_record(self, rec) -> None:
        with self._outbox_lock:
            self._outbox.append(rec)

    def _report(self) -> dict:
        from prometheus_client import generate_latest

        from adaserve.server.dashboard import engine_now
        from adaserve.server.state import engine_summary

        st = self.state
        info = self.eloop.ready_info
        shed, limited = st.report.counts()
        counters = self.eloop.snapshot.counters or {}
        return {
            "metrics": generate_latest(st.metrics.registry).decode(),
            "tenant_metrics": generate_latest(st.metrics.tenant_registry).decode(),
            "shed": shed,
            "rate_limited": limited,
            "usage": st.usage.by_tenant(),
            "inflight_tokens": self._inflight_tokens(),
            "class_targets": {
                c: {"tpot_ms": s.tpot_ms, "ttft_ms": s.ttft_ms}
                for c, s in self.eloop.class_slos.items()
            },
            "prices": {c.name: c.price_per_1k for c in info.classes},
            "class_names": [c.name for c in info.classes],
            "flops_per_token": info.flops_per_token_target,
            "model_name": st.model_name,
            "engine": {**engine_summary(self.eloop), "pid": os.getpid(), "draining": st.draining},
            # the dashboard's: the engine clock now (the records' finish times and the
            # samples' start are on it) and the counters the report has no room for
            "dashboard": {
                "clock": engine_now(st),
                "started_at": st.started_at,
                "accepted_per_pos": dict(counters.get("accepted_per_pos") or {}),
                "spec_drafts": counters.get("spec_drafts", 0),
            },
        }

    def _inflight_tokens(self) -> dict[str, int]:
        """Output tokens the requests in flight have produced so far, per tenant."""
        out: dict[str, int] = {}
        for h in self.eloop.tracked():
            if h.ctx is not None:
                out[h.ctx.tenant] = out.get(h.ctx.tenant, 0) + h.sent
        return out

    def _sync_loop(self) -> None:
        import ray

        while not self._stop.wait(self._period):
            try:
                with self._outbox_lock:
                    recs, self._outbox = self._outbox, []
                samples, seen = self.state.iterations.since(self._samples_seen)
                ref: Any = self.ledger.push.remote(
                    self.replica_id, self._report(), recs, self.quotas.take_pending(), samples
                )
                order = ray.get(ref, timeout=10)
                self._samples_seen = seen
            except Exception:  # the ledger is gone (shutdown) or slow: try again
                if self._stop.is_set():
                    return
                log.warning("could not push this replica's report", exc_info=True)
                continue
            grace = order.get("drain_grace_s")
            if grace is not None and not self._drain_seen:
                self._drain_seen = True
                self.state.begin_drain(grace)
