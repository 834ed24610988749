"""Reading the ledger back: usage totals by tenant, class and day or hour (from the
hourly roll-up), request rows (paged), refusals, and the per-class audit report of any
past window. Times are UTC seconds since the epoch; every function takes a ``Store``."""

from __future__ import annotations

import math
from collections.abc import Sequence

from adaserve.ledger.store import Store

GRANULARITY = {"day": 24, "hour": 1}
USAGE_FIELDS = (
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "charge",
    "slo_met",
    "degraded",
    "aborted",
)
REQUEST_FIELDS = (
    "id", "tenant", "key_id", "class_asked", "class", "prompt_tokens", "completion_tokens",
    "charge", "ttft_ms", "tpot_ms", "slo_met", "finish_reason", "arrival", "finished",
    "replica", "choices",
)  # fmt: skip
MAX_PAGE = 1000
MAX_TIME = 1e11  # seconds since the epoch (the year 5138): times beyond are refused


def _hours(since: float | None, until: float | None) -> tuple[list[str], list]:
    """Conditions on ``hour`` for [since, until): whole hours that overlap it."""
    where, args = [], []
    if since is not None:
        where.append("hour >= ?")
        args.append(int(since // 3600))
    if until is not None:
        where.append("hour < ?")
        args.append(int(math.ceil(until / 3600)))
    return where, args


def _window(col: str, since: float | None, until: float | None, **equal) -> tuple[list[str], list]:
    """Conditions for ``col`` in [since, until) and each ``column=value`` of ``equal``
    that is not None (``cls`` names the column ``class``)."""
    where, args = [], []
    for name, v in equal.items():
        if v is not None:
            where.append(f"{'class' if name == 'cls' else name} = ?")
            args.append(v)
    if since is not None:
        where.append(f"{col} >= ?")
        args.append(since)
    if until is not None:
        where.append(f"{col} < ?")
        args.append(until)
    return where, args


def _and(where: list[str]) -> str:
    return (" WHERE " + " AND ".join(where)) if where else ""


def usage_totals(
    store: Store,
    since: float | None = None,
    until: float | None = None,
    group: str = "day",
    tenant: str | None = None,
    cls: str | None = None,
) -> list[dict]:
    """Totals per (period, tenant, class), the period a UTC day or hour (its start in
    ``start``), from the hourly roll-up: a window is taken in whole hours."""
    per = GRANULARITY[group]
    where, args = _hours(since, until)
    more, more_args = _window("hour", None, None, tenant=tenant, cls=cls)
    where, args = where + more, args + more_args
    sums = ", ".join(f"SUM({f})" for f in USAGE_FIELDS)
    rows = store.query(
        f"SELECT hour / {per} AS p, tenant, class, {sums} FROM usage_hourly{_and(where)} "
        f"GROUP BY hour / {per}, tenant, class ORDER BY p, tenant, class",
        args,
    )
    out = []
    for p, t, c, *vals in rows:
        d = {"start": int(p) * per * 3600, "tenant": t, "class": c}
        for f, v in zip(USAGE_FIELDS, vals):
            d[f] = float(v or 0) if f == "charge" else int(v or 0)
        out.append(d)
    return out


def list_requests(
    store: Store,
    *,
    tenant: str | None = None,
    cls: str | None = None,
    since: float | None = None,
    until: float | None = None,
    slo_met: bool | None = None,
    after: str | None = None,
    limit: int = 100,
) -> tuple[list[dict], bool]:
    """Rows ordered by (finished, id), ``limit`` of them after the row ``after`` (an
    id); returns (rows, has_more)."""
    where, args = _window("finished", since, until, tenant=tenant, cls=cls)
    if slo_met is not None:
        where.append("slo_met = ?")
        args.append(int(slo_met))
    if after is not None:
        where.append(
            "(finished > (SELECT finished FROM requests WHERE id = ?) OR "
            "(finished = (SELECT finished FROM requests WHERE id = ?) AND id > ?))"
        )
        args += [after, after, after]
    rows = store.query(
        f"SELECT {', '.join(REQUEST_FIELDS)} FROM requests{_and(where)} "
        "ORDER BY finished, id LIMIT ?",
        [*args, limit + 1],
    )
    out = []
    for r in rows[:limit]:
        d = dict(zip(REQUEST_FIELDS, r))
        d["slo_met"] = bool(d["slo_met"])
        out.append(d)
    return out, len(rows) > limit


def has_request(store: Store, rid: str) -> bool:
    return bool(store.query("SELECT 1 FROM requests WHERE id = ?", [rid]))


def refusal_counts(
    store: Store,
    since: float | None = None,
    until: float | None = None,
    tenant: str | None = None,
) -> list[dict]:
    where, args = _window("at", since, until, tenant=tenant)
    rows = store.query(
        f"SELECT tenant, class, reason, status, COUNT(*) FROM refusals{_and(where)} "
        "GROUP BY tenant, class, reason, status ORDER BY tenant, class, reason",
        args,
    )
    return [
        {"tenant": t, "class": c, "reason": r, "status": int(s), "count": int(n)}
        for t, c, r, s, n in rows
    ]


def percentiles(values: Sequence[float], qs=(50, 95, 99)) -> dict[str, float | None]:
    """Nearest-rank percentiles (None for an empty list)."""
    v = sorted(values)
    out: dict[str, float | None] = {}
    for q in qs:
        out[f"p{q}"] = v[max(0, math.ceil(q / 100 * len(v)) - 1)] if v else None
    return out


def class_report(
    store: Store,
    since: float | None,
    until: float | None,
    tenant: str | None = None,
) -> dict:
    """The per-class audit of [since, until) from the request rows: requests,
    attainment, violations, TTFT/TPOT p50/p95/p99, degraded in (served here, asked for
    a stricter class) and out (asked here, served in a looser one), charge, refusals
    by reason."""
    where, args = _window("finished", since, until, tenant=tenant)
    rows = store.query(
        "SELECT class, class_asked, slo_met, ttft_ms, tpot_ms, charge, completion_tokens "
        f"FROM requests{_and(where)}",
        args,
    )
    classes: dict[str, dict] = {}

    def entry(c: str) -> dict:
        return classes.setdefault(
            c,
            {"requests": 0, "slo_met": 0, "ttft": [], "tpot": [], "degraded_in": 0,
             "degraded_out": 0, "charge": 0.0, "completion_tokens": 0, "refusals": {}},
        )  # fmt: skip

    for c, asked, met, ttft, tpot, charge, out_tokens in rows:
        e = entry(c)
        e["requests"] += 1
        e["slo_met"] += int(met)
        e["charge"] += float(charge)
        e["completion_tokens"] += int(out_tokens)
        if ttft is not None:
            e["ttft"].append(float(ttft))
        if tpot is not None:
            e["tpot"].append(float(tpot))
        if asked != c:
            e["degraded_in"] += 1
            entry(asked)["degraded_out"] += 1
    for r in refusal_counts(store, since, until, tenant):
        rf = entry(r["class"])["refusals"]
        rf[r["reason"]] = rf.get(r["reason"], 0) + r["count"]
    out = {}
    for c, e in sorted(classes.items()):
        n = e["requests"]
        out[c] = {
            "requests": n,
            "attainment": e["slo_met"] / n if n else None,
            "violations": n - e["slo_met"],
            "ttft_ms": percentiles(e["ttft"]),
            "tpot_ms": percentiles(e["tpot"]),
            "degraded_in": e["degraded_in"],
            "degraded_out": e["degraded_out"],
            "completion_tokens": e["completion_tokens"],
            "charge": e["charge"],
            "refusals": e["refusals"],
        }
    return {"since": since, "until": until, "classes": out}


def daily_class_report(
    store: Store, since: float | None = None, until: float | None = None
) -> list[dict]:
    """Per UTC day and class: requests, attainment, tokens, charge (the hourly
    roll-up, so it stays fast on months of rows)."""
    where, args = _hours(since, until)
    rows = store.query(
        "SELECT hour / 24 AS d, class, SUM(requests), SUM(slo_met), SUM(prompt_tokens), "
        f"SUM(completion_tokens), SUM(charge), SUM(degraded) FROM usage_hourly{_and(where)} "
        "GROUP BY hour / 24, class ORDER BY d, class",
        args,
    )
    return [
        {
            "day": int(d) * 86400,
            "class": c,
            "requests": int(n),
            "attainment": int(met) / int(n) if n else None,
            "prompt_tokens": int(pt),
            "completion_tokens": int(ct),
            "charge": float(ch),
            "degraded": int(dg),
        }
        for d, c, n, met, pt, ct, ch, dg in rows
    ]


def parse_time(s: str) -> float:
    """A time as UTC seconds since the epoch: a number of seconds, an ISO 8601 date
    (``2026-12-06``: its UTC midnight) or date and time (``2026-12-06T10:00:00Z``; no
    zone: UTC), or ``N[dhm]`` / ``-N[dhm]`` (that long before now). ``ValueError``
    otherwise."""
    import datetime as dt
    import time as _time

    t = s.strip()
    if not t:
        raise ValueError("empty time")
    ago = t[1:] if t[0] == "-" else t
    if ago[-1:] in ("d", "h", "m") and ago[:-1].replace(".", "", 1).isdigit():
        unit = {"d": 86400, "h": 3600, "m": 60}[ago[-1]]
        return _time.time() - float(ago[:-1]) * unit
    try:
        v = float(t)
    except ValueError:
        pass
    else:
        if not math.isfinite(v) or not 0 <= v < MAX_TIME:
            raise ValueError(f"bad time {s!r}: seconds since the epoch, 0 to {MAX_TIME:.0f}")
        return v
    try:
        d = dt.datetime.fromisoformat(t.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"bad time {s!r}: seconds since the epoch, an ISO 8601 date or date-time, or -N[dhm]"
        ) from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=dt.timezone.utc)
    return max(0.0, d.timestamp())
