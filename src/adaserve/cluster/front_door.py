"""The front door of a service of N engine replicas: one OpenAI-compatible address.

A plain ASGI app, run by the single server's uvicorn set-up (``server.http_runtime.make_server``:
the same header and body timeouts, connection cap and JSON errors for what uvicorn
cannot parse). Per request:

- ``POST`` while draining: 503 ``server_shutdown``, and ``/health`` 503, as the single
  server;
- ``/metrics`` and ``/v1/slo/report``: answered here for the whole service, from the
  replicas' reports in the ``Ledger`` (``merge``), with the single server's key rules;
- ``/dashboard``, ``/v1/dashboard/data`` and ``/v1/dashboard/session``: the single
  server's dashboard (``server.dashboard.Dashboard``: the same page, admin-only auth and
  session cookies, the sessions held here), its data the replicas' merged
  (``merge.merge_dashboard``: service-wide tables, per-replica timelines);
- everything else is read (body limit and timeout as the single server) and forwarded
  through the deployment's handle, whose request router picks the replica (the first
  argument, ``route``, is what the router reads: class, explicit targets, prompt and
  output lengths). The replica's app answers; its messages are relayed as they come
  (SSE chunk by chunk), with an ``x-adaserve-replica`` header.

Faults: a request that fails before a replica has taken it (the replica died, or is
being replaced) is sent elsewhere (``retries`` times); one in flight on a replica that
fails ends with a 503 ``replica_failed`` OpenAI-shaped error, or, once its SSE stream
has begun, with an SSE ``error`` event and ``data: [DONE]``. None is run twice. A client that leaves cancels the
replica's stream, which aborts the engine request.

What a failed replica had already streamed is counted: each body item carries the
request's output tokens so far (``replica.relay``), and when a stream that had begun
fails, the front door tells the ledger (``Ledger.interrupted``) how many of them it
had relayed to the client; once the replica is taken for dead they are in the
tenant's usage and the report (a replica that lives on counts its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING

from starlette.datastructures import Headers

from adaserve.cluster.asgi import request_data
from adaserve.cluster.merge import merge_dashboard, merge_metrics, merge_report
from adaserve.cluster.seat_routes import SeatRoutes, caller_key
from adaserve.server.auth import AUTH_PATHS, TenantRegistry, client_of
from adaserve.server.config import ServerConfig
from adaserve.server.dashboard import Dashboard
from adaserve.server.engine_errors import shutdown_error
from adaserve.server.errors import ApiError, retry_after
from adaserve.server.render import dumps, error_response
from adaserve.server.slo_resolution import SLO_HEADERS
from adaserve.server.state import MAX_BODY_BYTES
from adaserve.util.jsonsafe import json_safe

if TYPE_CHECKING:
    from adaserve.ledger import Ledger

log = logging.getLogger("adaserve.cluster")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def replica_failed(what: str) -> ApiError:
    return ApiError(
        503,
        f"the replica serving this request failed ({what}); retry",
        type="service_unavailable_error",
        code="replica_failed",
        headers=retry_after(1),
        reason="replica_failed",
    )


def _text_tokens(v) -> int:
    """A rough prompt length in tokens (the router needs a size, not the count)."""
    if isinstance(v, str):
        return max(1, math.ceil(len(v) / 4))
    if isinstance(v, list):
        if v and all(isinstance(x, int) for x in v):
            return len(v)
        return sum(_text_tokens(x) for x in v)
    if isinstance(v, dict):
        return _text_tokens(v.get("content") or v.get("text") or "")
    return 1


def route_of(path: str, headers: Headers, body: bytes) -> dict:
    """What the request router reads of a request: not validated (the replica does)."""
    if path not in GENERATION_PATHS:
        return {"generation": False}
    try:
        b = json.loads(body)
    except ValueError:
        b = None
    if not isinstance(b, dict):
        return {"generation": True}
    slo_v = b.get("slo")
    slo = slo_v if isinstance(slo_v, dict) else {}
    route = {"generation": True, "slo_class": b.get("slo_class")}
    for k, h in SLO_HEADERS.items():
        v = slo.get(k)
        if v is None:
            with contextlib.suppress(TypeError, ValueError):
                hv = headers.get(h)
                v = float(hv) if hv else None
        if isinstance(v, (int, float)) and v > 0:
            route[k] = float(v)
    prompt = b.get("messages") if "messages" in b else b.get("prompt")
    route["prompt_tokens"] = _text_tokens(prompt)
    mt = b.get("max_completion_tokens") or b.get("max_tokens")
    route["max_tokens"] = int(mt) if isinstance(mt, int) and mt > 0 else 256
    return route


class FailedRequests:
    """The requests the front door answered ``replica_failed`` (no replica finished them),
    by class: in ``/metrics`` as vLLM counts an ended request
    (``vllm:request_success_total{finished_reason="abort"}``) and as ours
    (``adaserve:requests_finished_total{finish_reason="replica_failed"}``), and in the
    report (``engine.replica_failed`` and each class's ``finish_reasons``)."""

    def __init__(self, model_name: str):
        from prometheus_client import CollectorRegistry, Counter

        self.model_name = model_name
        self.by_class: dict[str, int] = {}
        self._reg = CollectorRegistry()
        self._success = Counter(
            "vllm:request_success",
            "Finished requests by vLLM finish reason (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=self._reg,
        )
        self._finished = Counter(
            "adaserve:requests_finished",
            "Finished requests by class and finish reason.",
            ["model_name", "slo_class", "finish_reason"],
            registry=self._reg,
        )

    def count(self, cls: str) -> None:
        self.by_class[cls] = self.by_class.get(cls, 0) + 1
        self._success.labels(self.model_name, "abort").inc()
        self._finished.labels(self.model_name, cls, "replica_failed").inc()

    def text(self) -> str:
        """The counters as Prometheus text (empty before any failure)."""
        if not self.by_class:
            return ""
        from prometheus_client import generate_latest

        return generate_latest(self._reg).decode()

    def add_to(self, rep: dict) -> None:
        """Count the failed requests into a merged ``/v1/slo/report`` body."""
        rep.setdefault("engine", {})["replica_failed"] = dict(self.by_class)
        for cls, n in self.by_class.items():
            c = rep.get("classes", {}).get(cls)
            if c is not None:
                fr = c.setdefault("finish_reasons", {})
                fr["replica_failed"] = fr.get("replica_failed", 0) + n


class _InFlight:
    in_flight = 0


class FrontState:
    """What ``make_server``'s drain reads (``draining``, ``begin_drain``, ``cfg``,
    ``loop.in_flight``), and the front door's own state."""

    def __init__(self, cfg: ServerConfig, model_name: str, ledger):
        self.cfg = cfg
        self.model_name = model_name
        self.ledger = ledger
        self.tenants = TenantRegistry.for_config(cfg)
        # the replicas hold the limit derived from the model; this one bounds memory
        self.body_limit = cfg.max_body_bytes or MAX_BODY_BYTES
        self.loop = _InFlight()
        self.draining = False
        self._drain_started = False
        self.started_at = time.perf_counter()  # the dashboard's time axis starts here

    def begin_drain(self, grace_s: float | None = None) -> None:
        """Refuse new requests here; every replica gets the drain at its next push."""
        if self._drain_started:
            return
        self._drain_started = True
        self.draining = True
        grace = self.cfg.shutdown_grace_s if grace_s is None else grace_s
        log.info("draining %s replicas: %.1f s for requests in flight", self.model_name, grace)
        self.ledger.drain.remote(grace)


class FrontDoor:
    """The ASGI app (see the module docstring)."""

    def __init__(self, handle, ledger, cfg: ServerConfig, model_name: str, retries: int = 3):
        self.handle = handle
        self.ledger = ledger
        self.cfg = cfg
        self.retries = retries
        self.front = FrontState(cfg, model_name, ledger)
        self.state = SimpleNamespace(adaserve=self.front)
        self.dashboard = Dashboard(
            self.front.tenants, self._dashboard_data, title=f"adaserve dashboard: {model_name}"
        )
        self._usage: Ledger | None = (
            None  # the usage ledger, opened at the first interrupted stream
        )
        self._usage_lock = threading.Lock()
        self.failed = FailedRequests(model_name)  # answered replica_failed, by class
        self.seats = SeatRoutes()  # the replica holding each refused client's seat

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        try:
            if path.startswith("/v1/") and method == "POST" and self.front.draining:
                raise shutdown_error()
            if path == "/health" and self.front.draining:
                body = b"" if method == "HEAD" else b'{"status": "draining"}'
                await _send(send, 503, body, "application/json")
                return
            if path == "/metrics" and method == "GET":
                await self._metrics(scope, send)
                return
            if path == "/v1/slo/report" and method == "GET":
                await self._report(scope, send)
                return
            if path in Dashboard.PATHS:
                await self.dashboard.asgi(scope, receive, send)
                return
            if path.startswith("/v1/") or path in AUTH_PATHS:
                # the key is checked here too (the replica checks it again): wrong ones
                # are throttled in one place for the whole service and never forwarded
                self.front.tenants.authenticate(
                    Headers(scope=scope).get("authorization"), client_of(scope)
                )
            body = b""
            if method in ("POST", "PUT", "PATCH"):
                body = await self._read_body(scope, receive)
        except ApiError as e:
            await error_response(e)(scope, receive, send)
            return
        self.front.loop.in_flight += 1
        try:
            await self._forward(scope, receive, send, body)
        finally:
            self.front.loop.in_flight -= 1

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _read_body(self, scope, receive) -> bytes:
        from adaserve.server.app import _Guard

        replay = await _Guard(None, self.front)._buffer(scope, receive)  # type: ignore[arg-type]  # _buffer reads only the body limits, which FrontState has
        return (await replay())["body"]

    # ------------------------------------------------------------------ forwarding
    async def _forward(self, scope, receive, send, body: bytes) -> None:
        req = request_data(scope, body)
        headers = Headers(scope=scope)
        route = route_of(scope["path"], headers, body)
        caller = b""
        if route.get("generation"):
            # a retry goes back to the replica that holds its seat (``cluster.seat_routes``)
            caller = caller_key(headers.get("authorization"))
            home = self.seats.replica_for(headers, caller, body)
            if home is not None:
                route["replica"] = home
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        accepted = started = False
        sse = False
        last: BaseException | None = None
        acct: dict | None = None  # the request's accounting, from the replica
        relayed = 0  # its output tokens in what was sent to the client
        try:
            for attempt in range(self.retries + 1):
                gen = self.handle.options(stream=True, method_name="http").remote(route, req)
                it = gen.__aiter__()
                try:
                    while True:
                        nxt = asyncio.ensure_future(it.__anext__())
                        done, _ = await asyncio.wait({nxt, gone}, return_when="FIRST_COMPLETED")
                        if nxt not in done:  # the client left: cancel the replica's work
                            nxt.cancel()
                            gen.cancel()
                            return
                        try:
                            msg = nxt.result()
                        except StopAsyncIteration:  # ended without a whole response
                            raise RuntimeError("the replica's response ended early") from None
                        if msg[0] == "accepted":
                            accepted = True
                            continue
                        for m in msg[1] if msg[0] == "many" else (msg,):
                            if m[0] == "acct":
                                acct = m[1]
                            elif m[0] == "start":
                                started = True
                                sse = _is_sse(m[2])
                                if m[1] == 429 and route.get("generation"):
                                    self.seats.remember(_header_map(m[2]), caller, body)
                                await send(
                                    {"type": "http.response.start", "status": m[1], "headers": m[2]}
                                )
                            else:
                                await send(
                                    {"type": "http.response.body", "body": m[1], "more_body": m[2]}
                                )
                                if len(m) > 3:
                                    relayed = m[3]
                                if not m[2]:
                                    return
                except OSError:  # the client's connection is gone
                    gen.cancel()
                    return
                except Exception as e:  # the replica (or the way to it) failed
                    last = e
                    if accepted:
                        break
                    log.warning("replica failed before answering (try %d): %r", attempt + 1, e)
                    await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
            err = replica_failed(type(last).__name__ if last else "unknown")
            self.failed.count(route.get("slo_class") or self.cfg.default_class or "default")
            if started and acct is not None:
                self._count_interrupted(acct, relayed)
            if not started:
                await error_response(err)(scope, receive, send)
            elif sse:
                tail = f"data: {dumps(err.body())}\n\ndata: [DONE]\n\n".encode()
                await send({"type": "http.response.body", "body": tail, "more_body": False})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()

    def _count_interrupted(self, acct: dict, tokens: int) -> None:
        """A stream its replica broke off: what reached the client goes to the ledger."""
        log.warning(
            "replica %s failed mid-stream: %d output token(s) of tenant %s already sent",
            acct.get("replica"),
            tokens,
            acct.get("tenant"),
        )
        try:
            self.ledger.interrupted.remote(acct.get("replica"), acct, int(tokens))
        except Exception:  # the ledger is gone (shutdown): nothing to count into
            log.exception("could not count an interrupted stream")
        if self.cfg.usage.enabled and acct.get("id"):
            threading.Thread(
                target=self._bill_interrupted, args=(acct, int(tokens)), daemon=True
            ).start()

    def _bill_interrupted(self, acct: dict, tokens: int) -> None:
        """The usage ledger's row of a stream its replica broke off: the output tokens
        that reached the client. Keyed by the response id, as the replica's own row:
        whichever is committed first stands (a replica that died writes none), so the
        request is billed once, for what was delivered at most."""
        from adaserve.ledger import Ledger, UsageRow

        cls = acct.get("cls") or ""
        now = time.time()
        row = UsageRow(
            id=acct["id"],
            tenant=acct.get("tenant") or "",
            key_id=acct.get("key_id"),
            class_asked=acct.get("class_asked") or cls,
            cls=cls,
            prompt_tokens=int(acct.get("prompt_tokens") or 0),
            completion_tokens=tokens,
            charge=tokens * float(acct.get("price_per_1k") or 0.0) / 1000.0,
            ttft_ms=None,
            tpot_ms=None,
            slo_met=False,
            finish_reason="replica_failed",
            arrival=float(acct.get("arrival") or now),
            finished=now,
            replica=str(acct.get("replica") or ""),
        )
        try:
            with self._usage_lock:
                if self._usage is None:
                    self._usage = Ledger(self.cfg.usage)
            self._usage.record(row).result(60)
        except Exception:
            log.exception("could not write the usage row of an interrupted stream")

    # ------------------------------------------------------------------ service-wide
    def _caller(self, scope):
        """(tenant filter, tenants shown) for this caller, as the single server's."""
        reg = self.front.tenants
        if reg.open_mode:
            return None, True
        authorization = Headers(scope=scope).get("authorization")
        if not authorization:
            return None, False
        tenant = reg.authenticate(authorization, client_of(scope))
        return (None if tenant.admin else tenant.name), True

    async def _snapshots(self) -> dict:
        return await self.ledger.snapshots.remote()

    async def _metrics(self, scope, send) -> None:
        only, tenants = self._caller(scope)
        snaps = await self._snapshots()
        texts = {}
        for rid, s in snaps.items():
            text = s["report"].get("metrics", "")
            if tenants:
                text += s["report"].get("tenant_metrics", "")
            texts[rid] = (text, s["live"])
        # the requests no replica answered: counted here, where they ended
        texts["front-door"] = (self.failed.text(), True)
        body = await asyncio.to_thread(merge_metrics, texts, only)
        from prometheus_client import CONTENT_TYPE_LATEST

        await _send(send, 200, body, CONTENT_TYPE_LATEST)

    async def _report(self, scope, send) -> None:
        reg = self.front.tenants
        tenant = reg.authenticate(Headers(scope=scope).get("authorization"), client_of(scope))
        only = None if (reg.open_mode or tenant.admin) else tenant.name
        snaps = await self._snapshots()
        rep = await asyncio.to_thread(merge_report, snaps, only, self.front.model_name)
        if only is None:  # (a tenant's report is its own requests: the failed are not named)
            self.failed.add_to(rep)

        body = json.dumps(json_safe(rep), ensure_ascii=True, allow_nan=False).encode()
        await _send(send, 200, body, "application/json")

    async def _dashboard_data(self) -> dict:
        front = self.front
        snaps = await self.ledger.snapshots.remote(True)
        as_of = time.perf_counter() - front.started_at
        names = list(front.tenants.tenants)
        return await asyncio.to_thread(merge_dashboard, snaps, front.model_name, names, as_of)


def _header_map(headers) -> Headers:
    """A response's raw ``[(name, value)]`` headers, read case-insensitively."""
    return Headers(raw=[(bytes(k).lower(), bytes(v)) for k, v in headers])


def _is_sse(headers) -> bool:
    for k, v in headers:
        if bytes(k).lower() == b"content-type":
            return bytes(v).startswith(b"text/event-stream")
    return False


async def _wait_disconnect(receive) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def _send(send, status: int, body: bytes, ctype: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", ctype.encode()),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
