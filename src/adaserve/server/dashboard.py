"""The live dashboard: ``GET /dashboard`` (the page) and ``GET /v1/dashboard/data``
(its data, polled once a second).

Auth: the page is a public shell that carries no data (a browser cannot send a Bearer
header when it navigates); its sign-in form keeps the key in the tab's
``sessionStorage`` and sends it as ``Authorization: Bearer`` on every data request.
With API keys configured the data endpoint needs an admin tenant's key: no or an
invalid key is 401 (the ``/v1`` guard), a non-admin key 403, both OpenAI-shaped. A
``?key=`` query parameter is deliberately not supported: URLs end up in access logs,
browser history and ``Referer`` headers. In open mode (no keys) the data is open, as
every other endpoint is.

The data is what the server already tracks: the SLO report (``/v1/slo/report``'s
numbers, from the same ``ReportStore``), the report's records of the last
``ROLLING_WINDOW_S`` seconds for the rolling attainment, the engine snapshot's
counters (acceptance by position, fallbacks) and the per-iteration timeline
(``server.iterations``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from adaserve import dashboard_page
from adaserve.server.errors import ApiError
from adaserve.server.protocol import ErrorResponse
from adaserve.server.render import JSON
from adaserve.server.state import ServerState
from adaserve.server.usage import Usage

DATA_URL = "/v1/dashboard/data"
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


def dashboard_data(state: ServerState, now: float | None = None) -> dict:
    """The dashboard's view of the server at ``now`` (the engine's clock)."""
    if now is None:  # the clock the records' finish times are on
        clock = getattr(state.loop.engine, "clock", None)
        now = clock.now() if clock is not None else time.perf_counter()
    rep = state.slo_report(None)
    rolling = state.report.rolling(now, dashboard_page.ROLLING_WINDOW_S)
    snap = state.loop.snapshot
    counters = snap.counters or {}
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
    tenants = {name: dict(zero) for name in sorted(state.tenants.tenants)}
    for name, u in rep["tenants"].items():
        limited = u.get("rate_limited", {})
        for reason, n in limited.items():
            shed[f"quota: {reason}"] = shed.get(f"quota: {reason}", 0) + n
        tenants[name] = {**u["total"], "rate_limited": sum(limited.values())}
    eng = rep["engine"]
    return dashboard_page.view(
        title=f"adaserve: {state.model_name}",
        model=state.model_name,
        policy=eng["policy"],
        as_of_s=now - state.started_at,
        classes=classes,
        engine={k: eng[k] for k in ("running", "waiting", "kv_usage", "iterations")},
        accepted_per_pos=counters.get("accepted_per_pos") or {},
        spec_drafts=counters.get("spec_drafts", 0),
        shed=shed,
        fallback_iterations=eng["fallback_iterations"],
        tenants=tenants,
        timeline=state.iterations.series(list(classes)),
    )


def create_dashboard(state: ServerState) -> APIRouter:
    """The dashboard's two routes, for ``create_app`` to include."""
    router = APIRouter()
    page = dashboard_page.render(
        {"mode": "live", "data_url": DATA_URL, "interval_ms": 1000},
        title=f"adaserve dashboard: {state.model_name}",
    )

    @router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        """The page (a shell without data; see the module docstring for auth)."""
        return HTMLResponse(page, headers=_PAGE_HEADERS)

    @router.get(DATA_URL, responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse}})
    async def dashboard_data_route(request: Request):
        """The dashboard's data; with API keys configured, admin keys only."""
        tenant = request.state.tenant
        if not state.tenants.open_mode and not tenant.admin:
            raise ApiError(
                403,
                "the dashboard needs an API key with the admin role",
                type="permission_error",
                code="admin_required",
            )
        data = await asyncio.to_thread(dashboard_data, state)
        return JSON(data, headers=_NO_STORE)

    return router
