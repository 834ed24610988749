"""Which SLO class and targets a request gets (precedence in docs/server.md)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from adaserve.core.slo import SLO, SLOClass
from adaserve.errors import InvalidRequestError
from adaserve.server.config import Tenant
from adaserve.server.errors import ApiError
from adaserve.server.protocol import MAX_SLO_MS

SLO_HEADERS = {"ttft_ms": "x-slo-ttft-ms", "tpot_ms": "x-slo-tpot-ms"}
# every target a client can set (body ``slo`` fields; the first two also as headers)
TARGETS = ("tpot_ms", "ttft_ms", "max_queue_ms", "deadline_ms")


@dataclass(frozen=True)
class SLOChoice:
    """The outcome of SLO resolution for one request."""

    slo: SLO
    cls: SLOClass
    degraded_from: str | None = None
    source: str = "default"  # which input decided the class


# a plain decimal number: no sign, exponent, digit separators, inf/nan or non-ASCII
# digits (all of which Python's float() would take)
_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)", re.ASCII)


def _parse_header_ms(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    raw = raw.strip(" \t")
    v = float(raw) if _DECIMAL.fullmatch(raw) else math.nan
    if not (0 < v <= MAX_SLO_MS):  # also rejects nan
        raise ApiError(
            400,
            f"header {name} must be a positive decimal number of milliseconds (at most 1e9)",
            param=name,
            code="invalid_value",
        )
    return v


def capped(explicit: Mapping[str, float], base: SLO) -> dict[str, float]:
    """Explicit targets no stricter than the class's, field by field (every target a
    client can send: a smaller value is served sooner): one stricter than the class's
    is raised to it, and one the class does not set is dropped (no target is the
    loosest: the class promises nothing there)."""
    out = {}
    for k in TARGETS:
        want, have = explicit.get(k), getattr(base, k)
        if want is not None and have is not None:
            out[k] = max(want, have)
    return out


def _satisfies(target: SLO, want: Mapping[str, float]) -> bool:
    """Whether a class's targets are at least as strict as every explicit target."""
    for k in ("tpot_ms", "ttft_ms"):
        w = want.get(k)
        if w is None:
            continue
        have = getattr(target, k)
        if have is None or have > w:
            return False
    return True


def resolve_slo(
    *,
    classes: tuple[SLOClass, ...],
    class_slos: Mapping[str, SLO],
    tenant: Tenant,
    default_class: str,
    service_tiers: Mapping[str, str],
    slo: Mapping[str, float | None] | None = None,
    slo_class: str | None = None,
    priority: int | None = None,
    service_tier: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> SLOChoice:
    """Decide a request's class and targets (precedence in docs/server.md).

    Class: ``slo_class`` > ``priority`` > ``service_tier`` > (when none of these is
    given) the loosest class that meets the explicit targets, if the default does not >
    the tenant's default > the server's default. Targets: body ``slo`` > ``x-slo-*``
    headers > the class's own, every one capped at the class's strictness (``capped``)
    unless the tenant has ``free_targets`` (open mode does). A class the tenant may not use is refused (403)
    or downgraded (targets then capped at the new class). ``on_overload`` (body ``slo``
    > the tenant's) says whether admission may degrade the request instead of refusing.
    """
    by_name = {c.name: c for c in classes}
    explicit: dict[str, float] = {}
    for key, header in SLO_HEADERS.items():
        v = _parse_header_ms(headers or {}, header)
        if v is not None:
            explicit[key] = v
    slo = dict(slo or {})
    on_overload: Any = slo.pop("on_overload", None) or tenant.on_overload
    for k, v in slo.items():
        if v is not None:
            explicit[k] = float(v)

    source = "default"
    if slo_class is not None:
        if slo_class not in by_name:
            raise ApiError(
                400,
                f"unknown slo_class {slo_class!r}; known: {', '.join(by_name)}",
                param="slo_class",
                code="invalid_slo_class",
            )
        cls, source = by_name[slo_class], "slo_class"
    elif priority is not None:
        ordered = sorted(classes, key=lambda c: (c.priority, c.rank))
        cls = next((c for c in ordered if c.priority >= priority), ordered[-1])
        source = "priority"
    elif service_tier is not None:
        name = service_tiers.get(service_tier) or _default_tier(
            service_tier, classes, tenant, default_class
        )
        cls, source = by_name[name], "service_tier"
    else:
        cls = by_name[tenant.default_class or default_class]
        if tenant.default_class:
            source = "tenant_default"

    # no class named, explicit targets stricter than the default promises: the class is
    # the loosest one that is strict enough (the strictest when none is)
    named = slo_class is not None or priority is not None or service_tier is not None
    if explicit and not named and not _satisfies(class_slos[cls.name], explicit):
        ok = [c for c in classes if _satisfies(class_slos[c.name], explicit)]
        best = (
            max(ok, key=lambda c: (c.rank, -c.price_per_1k))
            if ok
            else min(classes, key=lambda c: c.rank)
        )
        if best.rank < cls.rank:
            cls, source = best, "slo"

    degraded_from = None
    if not tenant.may_use(cls.name):
        if tenant.on_forbidden_class != "downgrade":
            raise ApiError(
                403,
                f"tenant {tenant.name!r} may not use SLO class {cls.name!r}; "
                f"allowed: {', '.join(tenant.classes or ())}",
                type="permission_error",
                param="slo_class",
                code="slo_class_not_allowed",
            )
        target = _downgrade(cls, by_name, tenant)
        if target is None:
            raise ApiError(
                403,
                f"tenant {tenant.name!r} may not use SLO class {cls.name!r} "
                "and no allowed class to downgrade to",
                type="permission_error",
                param="slo_class",
                code="slo_class_not_allowed",
            )
        degraded_from, cls = cls.name, target

    # a tenant gets at most its class's strictness, unless it may set free targets
    base = class_slos[cls.name]
    if degraded_from is not None or not tenant.free_targets:
        explicit = capped(explicit, base)

    try:
        final = SLO(
            tpot_ms=explicit.get("tpot_ms", base.tpot_ms),
            ttft_ms=explicit.get("ttft_ms", base.ttft_ms),
            max_queue_ms=explicit.get("max_queue_ms", base.max_queue_ms),
            deadline_ms=explicit.get("deadline_ms", base.deadline_ms),
            cls=cls.name,
            on_overload=on_overload,
        )
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param=f"slo.{e.param}" if e.param else "slo") from None
    return SLOChoice(final, cls, degraded_from, source)


def _default_tier(
    tier: str, classes: tuple[SLOClass, ...], tenant: Tenant, default_class: str
) -> str:
    """OpenAI service tiers: priority -> strictest, flex -> loosest, else the default."""
    if tier == "priority":
        return min(classes, key=lambda c: c.rank).name
    if tier == "flex":
        return max(classes, key=lambda c: c.rank).name
    return tenant.default_class or default_class


def _downgrade(cls: SLOClass, by_name: Mapping[str, SLOClass], tenant: Tenant) -> SLOClass | None:
    seen = {cls.name}
    c = cls
    while c.degrade_to and c.degrade_to not in seen and c.degrade_to in by_name:
        c = by_name[c.degrade_to]
        seen.add(c.name)
        if tenant.may_use(c.name):
            return c
    if tenant.default_class and tenant.may_use(tenant.default_class):
        return by_name.get(tenant.default_class)
    return None
