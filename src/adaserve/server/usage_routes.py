"""Reading the usage ledger over HTTP: ``GET /v1/usage`` (totals by tenant, class and
day or hour), ``GET /v1/usage/requests`` (the rows, paged as OpenAI's lists are:
``limit``, ``after``, ``has_more``), and the per-class audit of a past window behind
``GET /v1/slo/report?since=...&until=...``. A tenant's key sees its own usage only
(asking for another tenant's is 403); the admin key (or open mode) sees every
tenant's."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from adaserve.ledger import query
from adaserve.server.config import Tenant
from adaserve.server.errors import ApiError
from adaserve.server.render import JSON
from adaserve.server.state import ServerState

TRUE = ("true", "1", "yes")
FALSE = ("false", "0", "no")


def _time(request: Request, name: str) -> float | None:
    v = request.query_params.get(name)
    if v is None:
        return None
    try:
        return query.parse_time(v)
    except ValueError as e:
        raise ApiError(400, f"{name}: {e}", param=name) from None


def window(request: Request) -> tuple[float | None, float | None]:
    since, until = _time(request, "since"), _time(request, "until")
    if since is not None and until is not None and until <= since:
        raise ApiError(400, "until must be after since", param="until")
    return since, until


def scope_tenant(state: ServerState, request: Request) -> str | None:
    """The tenant whose usage the caller may read: its own, or (admin, open mode) the
    ``tenant`` asked for (None: every tenant)."""
    tenant: Tenant = request.state.tenant
    asked = request.query_params.get("tenant")
    if state.tenants.open_mode or tenant.admin:
        return asked or None
    if asked is not None and asked != tenant.name:
        raise ApiError(
            403,
            "a tenant's key reads its own usage only; another tenant's needs the admin key",
            param="tenant",
            type="permission_error",
            code="tenant_not_allowed",
        )
    return tenant.name


async def read(fn, *args, **kw):
    """A ledger query off the event loop; an unreachable database is 503."""
    try:
        return await asyncio.to_thread(fn, *args, **kw)
    except ApiError:
        raise
    except Exception as e:
        raise ApiError(
            503,
            f"the usage database cannot be read now: {' '.join(str(e).split())[:200]}",
            type="service_unavailable_error",
            code="usage_db_unavailable",
        ) from None


def _ledger(state: ServerState):
    if state.ledger is None:
        raise ApiError(
            409,
            "the usage ledger is off (--usage-db none): usage is in memory only, see "
            "/v1/slo/report",
            code="no_usage_ledger",
        )
    return state.ledger


def _bool(request: Request, name: str) -> bool | None:
    v = request.query_params.get(name)
    if v is None:
        return None
    if v.lower() in TRUE:
        return True
    if v.lower() in FALSE:
        return False
    raise ApiError(400, f"{name} must be true or false", param=name)


def _limit(request: Request) -> int:
    v = request.query_params.get("limit", "100")
    try:
        n = int(v)
    except ValueError:
        n = 0
    if not 1 <= n <= query.MAX_PAGE:
        raise ApiError(400, f"limit must be an integer from 1 to {query.MAX_PAGE}", "limit")
    return n


def create_usage_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/usage")
    async def usage(request: Request):
        """Totals per (day or hour, tenant, class): requests, tokens, charge, SLO met,
        degraded and aborted requests; refusals per tenant, class and reason. Query:
        ``since``, ``until`` (epoch seconds, ISO 8601, or -N[dhm]), ``group_by``
        (day|hour), ``tenant`` (admin), ``slo_class``."""
        group = request.query_params.get("group_by", "day")
        if group not in query.GRANULARITY:
            raise ApiError(400, "group_by must be 'day' or 'hour'", param="group_by")
        since, until = window(request)
        tenant = scope_tenant(state, request)
        cls = request.query_params.get("slo_class")
        store = _ledger(state).store
        rows = await read(query.usage_totals, store, since, until, group, tenant, cls)
        refusals = await read(query.refusal_counts, store, since, until, tenant)
        data = [
            {
                "object": "usage.bucket",
                "start": r["start"],
                "tenant": r["tenant"],
                "slo_class": r["class"],
                **{k: r[k] for k in query.USAGE_FIELDS},
                "total_tokens": r["prompt_tokens"] + r["completion_tokens"],
            }
            for r in rows
        ]
        return JSON(
            {
                "object": "usage",
                "group_by": group,
                "since": since,
                "until": until,
                "data": data,
                "refusals": [
                    {**{k: v for k, v in r.items() if k != "class"}, "slo_class": r["class"]}
                    for r in refusals
                ],
            }
        )

    @router.get("/v1/usage/requests")
    async def usage_requests(request: Request):
        """The ledger's rows, oldest first: ``limit`` (1-1000, default 100) after the
        row ``after`` (an id), filtered by ``tenant`` (admin), ``slo_class``,
        ``since``/``until`` (finish time) and ``slo_met``."""
        since, until = window(request)
        tenant = scope_tenant(state, request)
        ledger = _ledger(state)
        kw = dict(
            tenant=tenant,
            cls=request.query_params.get("slo_class"),
            since=since,
            until=until,
            slo_met=_bool(request, "slo_met"),
            after=request.query_params.get("after"),
            limit=_limit(request),
        )
        rows, more = await read(query.list_requests, ledger.store, **kw)
        data = []
        for r in rows:
            r = dict(r)
            r["slo_class"] = r.pop("class")
            data.append({"object": "usage.request", **r})
        return JSON(
            {
                "object": "list",
                "data": data,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None,
                "has_more": more,
            }
        )

    return router


async def past_report(state: ServerState, request: Request, only: str | None) -> dict:
    """``/v1/slo/report`` of a past window, from the ledger."""
    since, until = window(request)
    ledger = _ledger(state)
    rep = await read(query.class_report, ledger.store, since, until, only)
    rep["object"] = "slo.report"
    rep["source"] = "ledger"
    rep["model"] = state.model_name
    rep["tenant"] = only
    return rep
