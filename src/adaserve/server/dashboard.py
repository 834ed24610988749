"""The live dashboard: ``GET /dashboard`` (the page), ``GET /v1/dashboard/data`` (its
data, polled once a second) and ``POST`` / ``DELETE /v1/dashboard/session`` (sign in
and out). ``Dashboard`` holds the rules and the routes; the single server mounts them
with ``create_dashboard``, the scale-out front door (``cluster.front_door``) serves the
same object from its own ASGI code, with merged data.

Auth, with API keys configured (in open mode everything here is open, as every other
endpoint is):

- ``GET /dashboard`` needs an admin credential, an ``Authorization: Bearer`` admin key
  or the dashboard's session cookie: without one (or with an invalid or expired one) it
  answers 401 with the sign-in page, with a non-admin one 403 with the sign-in page and
  the reason, with an admin one 200 and the dashboard. No page carries data.
- Sign-in: the page's form sends ``POST /v1/dashboard/session`` with the key as
  ``Authorization: Bearer``; an admin key gets 204 and a ``Set-Cookie`` of a random
  session token (``secrets``; HttpOnly, SameSite=Strict, Path=/, Max-Age
  ``SESSION_TTL_S``; Secure over https), a non-admin key 403, no or an invalid key 401
  (OpenAI-shaped errors). The key itself is not kept anywhere in the browser. Sessions
  live in this process's memory (``Sessions``: at most ``MAX_SESSIONS``, the oldest
  dropped first; each expires ``SESSION_TTL_S`` after sign-in) and are keyed by the
  token's SHA-256. ``DELETE /v1/dashboard/session`` signs out (drops the session and
  clears the cookie).
- ``/v1/dashboard/data`` accepts the admin key (Bearer) or the session cookie; no or an
  invalid credential is 401, a non-admin one 403. A Bearer header, when sent, is what
  counts (a cookie beside it is not looked at).

A ``?key=`` query parameter is deliberately not supported: URLs end up in access logs,
browser history and ``Referer`` headers. SameSite=Strict keeps the cookie off other
sites' requests, and signing in needs the ``Authorization`` header, which no other
site's page can send here.

The data is what the server already tracks: the SLO report (``/v1/slo/report``'s
numbers, from the same ``ReportStore``), the report's records of the last
``ROLLING_WINDOW_S`` seconds for the rolling attainment, the engine snapshot's
counters (acceptance by position, fallbacks) and the per-iteration timeline
(``server.iterations``); ``report_view`` turns a report into the page's view, for the
single server's report and for the front door's merged one alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from starlette.datastructures import Headers
from starlette.requests import cookie_parser
from starlette.responses import HTMLResponse, Response

from adaserve.server.auth import TenantRegistry, client_of
from adaserve.server.config import Tenant
from adaserve.server.errors import ApiError
from adaserve.server.protocol import ErrorResponse
from adaserve.server.render import JSON, error_response
from adaserve.server.usage import Usage
from adaserve.util import dashboard_page

if TYPE_CHECKING:  # the state holds the engine (torch): the front door imports this
    from adaserve.server.state import ServerState

PAGE_URL = "/dashboard"
DATA_URL = "/v1/dashboard/data"
SESSION_URL = "/v1/dashboard/session"
# the paths whose routes check credentials themselves (a cookie is one): the single
# server's /v1 guard leaves them to ``Dashboard``
SELF_AUTH_PATHS = frozenset({DATA_URL, SESSION_URL})
COOKIE = "adaserve_dashboard"
SESSION_TTL_S = 8 * 3600
MAX_SESSIONS = 256
INTERVAL_MS = 1000

_NO_STORE = {"Cache-Control": "no-store"}
# the page loads nothing from anywhere: its script and style are inline, and it talks
# only to this server
_PAGE_HEADERS = {
    **_NO_STORE,
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; form-action 'none'; frame-ancestors 'none'; "
        "base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
}


# ---------------------------------------------------------------------- the data


def report_view(
    rep: dict,
    *,
    title: str,
    as_of_s: float,
    rolling: dict,
    tenant_names,
    accepted_per_pos: dict,
    spec_drafts: int,
    timeline: dict,
    recent_timeline: dict | None = None,
    replicas: dict | None = None,
    timeline_replica: str | None = None,
) -> dict:
    """The page's view (``dashboard_page.view``) of an SLO report (``/v1/slo/report``'s
    body, a single server's or the front door's merged one): its classes with their
    ``rolling`` attainment, sheds and quota refusals by reason, a row per tenant in
    ``tenant_names`` (zeros until it has usage) and per tenant of the report, the
    engine's gauges and fallbacks, the given counters and timeline (and the service's
    ``replicas``, see ``dashboard_page.view``)."""
    classes = {}
    shed: dict[str, int] = {}
    for name, c in rep["classes"].items():
        classes[name] = {
            "targets": c["targets"],
            "requests": c["requests"],
            "attained": c["attained"],
            "attainment": c["attainment"],
            "rolling": rolling.get(name, {"requests": 0, "attained": 0, "attainment": None}),
            "ttft_ms": c["ttft_ms"],
            "tpot_ms": c["tpot_ms"],
            "verification": c["verification"],
            "shed": c["shed"],
        }
        for reason, n in c["shed"].items():
            shed[reason] = shed.get(reason, 0) + n
    # every configured tenant has a row, the ones that have not finished a request yet
    # (or whose requests were all refused) with zeros
    zero = {**dataclasses.asdict(Usage()), "rate_limited": 0}
    tenants = {name: dict(zero) for name in sorted(tenant_names)}
    for name, u in rep["tenants"].items():
        limited = u.get("rate_limited", {})
        for reason, n in limited.items():
            shed[f"quota: {reason}"] = shed.get(f"quota: {reason}", 0) + n
        tenants[name] = {**u["total"], "rate_limited": sum(limited.values())}
    eng = rep["engine"]
    return dashboard_page.view(
        title=title,
        model=rep.get("model"),
        policy=eng["policy"],
        as_of_s=as_of_s,
        classes=classes,
        engine={
            **{k: eng[k] for k in ("running", "waiting", "kv_usage", "iterations")},
            # where the class targets come from, the passes over 3x their prediction
            # and the drift from the profile (a merged front-door report has none)
            "unloaded_tpot_ms": eng.get("unloaded_tpot_ms"),
            "profile": eng.get("profile"),
            "threads": eng.get("threads"),
            "stalls": eng.get("stalls") or {},
            "drift": eng.get("drift") or {},
            "structured": eng.get("structured"),
            "prefix_cache": eng.get("prefix_cache"),
            # refusals by class and reason, promised against realised attainment
            "admission": eng.get("admission"),
        },
        accepted_per_pos=accepted_per_pos,
        spec_drafts=spec_drafts,
        shed=shed,
        fallback_iterations=eng.get("fallback_iterations", {}),
        tenants=tenants,
        timeline=timeline,
        recent_timeline=recent_timeline,
        replicas=replicas,
        timeline_replica=timeline_replica,
    )


def engine_now(state: ServerState) -> float:
    """The engine's clock now: the one the records' finish times are on."""
    e = state.loop.engine  # None before the loop built it
    return e.clock.now() if e is not None else time.perf_counter()


def dashboard_data(state: ServerState, now: float | None = None) -> dict:
    """The dashboard's view of the server at ``now`` (the engine's clock)."""
    if now is None:
        now = engine_now(state)
    rep = state.slo_report(None)
    counters = state.loop.snapshot.counters or {}
    return report_view(
        rep,
        title=f"adaserve: {state.model_name}",
        as_of_s=now - state.started_at,
        rolling=state.report.rolling(now, dashboard_page.ROLLING_WINDOW_S),
        tenant_names=state.tenants.tenants,
        accepted_per_pos=counters.get("accepted_per_pos") or {},
        spec_drafts=counters.get("spec_drafts", 0),
        timeline=state.iterations.series(list(rep["classes"])),
    )


# ---------------------------------------------------------------------- sessions


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class Sessions:
    """Dashboard sessions in memory: token digest -> (tenant name, expiry); bounded
    (the oldest goes first), expiring ``ttl_s`` after sign-in; thread-safe."""

    def __init__(
        self, ttl_s: float = SESSION_TTL_S, max_sessions: int = MAX_SESSIONS, clock=time.monotonic
    ):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._lock = threading.Lock()
        self._by_digest: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            self._expire(self.clock())
            return len(self._by_digest)

    def _expire(self, now: float) -> None:
        # one TTL for all: insertion order is expiry order
        while self._by_digest:
            d, (_, until) = next(iter(self._by_digest.items()))
            if until > now:
                return
            del self._by_digest[d]

    def create(self, tenant: str) -> str:
        """A new session of ``tenant``; returns its token (the cookie's value)."""
        token = secrets.token_urlsafe(32)
        now = self.clock()
        with self._lock:
            self._expire(now)
            while len(self._by_digest) >= self.max_sessions:
                self._by_digest.popitem(last=False)
            self._by_digest[_digest(token)] = (tenant, now + self.ttl_s)
        return token

    def tenant(self, token: str) -> str | None:
        """The tenant of a live session, or None."""
        with self._lock:
            self._expire(self.clock())
            hit = self._by_digest.get(_digest(token))
        return hit[0] if hit else None

    def drop(self, token: str) -> None:
        with self._lock:
            self._by_digest.pop(_digest(token), None)


def admin_required() -> ApiError:
    return ApiError(
        403,
        "the dashboard needs an API key with the admin role",
        type="permission_error",
        code="admin_required",
    )


def _session_gone() -> ApiError:
    return ApiError(
        401,
        "the dashboard session has expired or was signed out: sign in again",
        type="authentication_error",
        code="invalid_session",
    )


def _cookie(headers: Headers) -> str | None:
    raw = headers.get("cookie")
    return (cookie_parser(raw).get(COOKIE) or None) if raw else None


# ---------------------------------------------------------------------- the routes


class Dashboard:
    """The dashboard's credential rules and responses (see the module docstring).
    ``data``: an async function returning the view dict; ``title``: the page's."""

    def __init__(
        self,
        tenants: TenantRegistry,
        data: Callable[[], Awaitable[dict]],
        title: str,
        sessions: Sessions | None = None,
    ):
        self.tenants = tenants
        self.data = data
        self.title = title
        self.sessions = sessions if sessions is not None else Sessions()
        self._pages: dict[tuple, str] = {}

    # ------------------------------------------------------------------ credentials
    def credential(self, headers: Headers, client: str | None = None) -> tuple[Tenant, bool]:
        """(the caller's tenant, whether by session cookie); raises ``ApiError`` 401 (429
        while ``client``'s address is locked for wrong keys: ``auth.AuthThrottle``)."""
        reg = self.tenants
        authorization = headers.get("authorization")
        if reg.open_mode or authorization:
            return reg.authenticate(authorization, client), False
        token = _cookie(headers)
        if token is None:
            reg.authenticate(None)  # 401 missing_api_key
        name = self.sessions.tenant(token) if token is not None else None
        tenant = reg.tenants.get(name) if name is not None else None
        if tenant is None:
            raise _session_gone()
        return tenant, True

    def admin(self, headers: Headers, client: str | None = None) -> tuple[Tenant, bool]:
        """``credential``, and 403 unless the tenant is an admin (or in open mode)."""
        tenant, by_session = self.credential(headers, client)
        if not self.tenants.open_mode and not tenant.admin:
            raise admin_required()
        return tenant, by_session

    # ------------------------------------------------------------------ responses
    def _page(self, boot: dict) -> str:
        key = tuple(sorted(boot.items()))
        if key not in self._pages:
            self._pages[key] = dashboard_page.render(boot, title=self.title)
        return self._pages[key]

    def page(self, headers: Headers, secure: bool = False, client: str | None = None) -> Response:
        """``GET /dashboard``: 200 the dashboard, or 401 / 403 / 429 the sign-in page."""
        try:
            _, by_session = self.admin(headers, client)
        except ApiError as e:
            boot: dict[str, Any] = {
                "mode": "signin",
                "session_url": SESSION_URL,
                "message": e.message,
            }
            resp = HTMLResponse(
                self._page(boot), status_code=e.status, headers={**_PAGE_HEADERS, **e.headers}
            )
            if e.status == 401:
                resp.headers["WWW-Authenticate"] = "Bearer"
                if _cookie(headers) is not None:  # a stale session: forget it here too
                    self._clear(resp, secure)
            return resp
        boot = {
            "mode": "live",
            "data_url": DATA_URL,
            "session_url": SESSION_URL,
            "interval_ms": INTERVAL_MS,
            "session": by_session,
        }
        return HTMLResponse(self._page(boot), headers=_PAGE_HEADERS)

    async def data_response(self, headers: Headers, client: str | None = None) -> Response:
        """``GET /v1/dashboard/data``."""
        self.admin(headers, client)
        return JSON(await self.data(), headers=_NO_STORE)

    def sign_in(
        self, headers: Headers, secure: bool = False, client: str | None = None
    ) -> Response:
        """``POST /v1/dashboard/session``: the admin key (Bearer) for a session cookie."""
        reg = self.tenants
        resp = Response(status_code=204, headers=_NO_STORE)
        if reg.open_mode:  # nothing to sign in to
            return resp
        tenant = reg.authenticate(headers.get("authorization"), client)
        if not tenant.admin:
            raise admin_required()
        resp.set_cookie(
            COOKIE,
            self.sessions.create(tenant.name),
            max_age=int(self.sessions.ttl_s),
            path="/",
            secure=secure,
            httponly=True,
            samesite="strict",
        )
        return resp

    def sign_out(self, headers: Headers, secure: bool = False) -> Response:
        """``DELETE /v1/dashboard/session``: drop the session, clear the cookie."""
        token = _cookie(headers)
        if token is not None:
            self.sessions.drop(token)
        resp = Response(status_code=204, headers=_NO_STORE)
        self._clear(resp, secure)
        return resp

    @staticmethod
    def _clear(resp: Response, secure: bool) -> None:
        resp.delete_cookie(COOKIE, path="/", secure=secure, httponly=True, samesite="strict")

    # ------------------------------------------------------------------ plain ASGI
    ROUTES = {
        (PAGE_URL, "GET"): "page",
        (PAGE_URL, "HEAD"): "page",
        (DATA_URL, "GET"): "data",
        (SESSION_URL, "POST"): "sign_in",
        (SESSION_URL, "DELETE"): "sign_out",
    }
    PATHS = frozenset(p for p, _ in ROUTES)

    async def asgi(self, scope, receive, send) -> None:
        """Answer a request for one of ``PATHS`` (the front door's dispatch)."""
        headers = Headers(scope=scope)
        secure = scope.get("scheme") == "https"
        client = client_of(scope)
        what = self.ROUTES.get((scope["path"], scope["method"]))
        try:
            if what is None:
                allowed = sorted(m for p, m in self.ROUTES if p == scope["path"])
                raise ApiError(
                    405,
                    f"method {scope['method']} not allowed here",
                    type="invalid_request_error",
                    code="method_not_allowed",
                    headers={"Allow": ", ".join(allowed)},
                )
            if what == "page":
                resp = self.page(headers, secure, client)
            elif what == "data":
                resp = await self.data_response(headers, client)
            elif what == "sign_in":
                resp = self.sign_in(headers, secure, client)
            else:
                resp = self.sign_out(headers, secure)
        except ApiError as e:
            resp = error_response(e)
        await resp(scope, receive, send)


_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorResponse},
    403: {"model": ErrorResponse},
}


def create_dashboard(state: ServerState) -> APIRouter:
    """The dashboard's routes, for ``create_app`` to include."""
    dash = Dashboard(
        state.tenants,
        lambda: asyncio.to_thread(dashboard_data, state),
        title=f"adaserve dashboard: {state.model_name}",
    )
    state.dashboard = dash
    router = APIRouter()

    def secure(request: Request) -> bool:
        return request.url.scheme == "https"

    @router.get(PAGE_URL, response_class=HTMLResponse, include_in_schema=False)
    async def dashboard(request: Request) -> Response:
        """The page (no data in it; see the module docstring for auth)."""
        return dash.page(request.headers, secure(request), client_of(request.scope))

    @router.get(DATA_URL, responses=_ERRORS)
    async def dashboard_data_route(request: Request) -> Response:
        """The dashboard's data; with API keys configured, an admin key or session."""
        return await dash.data_response(request.headers, client_of(request.scope))

    @router.post(SESSION_URL, status_code=204, responses=_ERRORS)
    async def dashboard_sign_in(request: Request) -> Response:
        """Sign in to the dashboard: an admin key (Bearer) for a session cookie."""
        return dash.sign_in(request.headers, secure(request), client_of(request.scope))

    @router.delete(SESSION_URL, status_code=204)
    async def dashboard_sign_out(request: Request) -> Response:
        """Sign out of the dashboard (the session and its cookie)."""
        return dash.sign_out(request.headers, secure(request))

    return router
