"""Budgets longer than a minute: ``tokens_per_day``, ``requests_per_day`` and
``charge_per_month`` per tenant, over UTC days and months.

The book starts from the ledger (the hourly totals of the current day and month), so
a restart does not refill them, and adds every row recorded since. A request is
admitted while its tenant is under each budget: requests count from admission (those
in flight included, so concurrent requests cannot overshoot ``requests_per_day``);
tokens (prompt + completion) and charges count when the request finishes, so the last
request admitted under a token or charge budget may overshoot it by its own size.
Over a budget: 429 with ``error.reason`` naming it and ``Retry-After`` at the end of
the window (the next UTC midnight, or the first of the next month)."""

from __future__ import annotations

import calendar
import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

DAY_S = 86400


@dataclass(frozen=True)
class Budget:
    tokens_per_day: float | None = None
    requests_per_day: float | None = None
    charge_per_month: float | None = None

    @property
    def any(self) -> bool:
        return any(
            v is not None
            for v in (self.tokens_per_day, self.requests_per_day, self.charge_per_month)
        )


class OverBudget(Exception):
    def __init__(self, reason: str, limit: float, used: float, retry_after_s: float):
        self.reason = reason
        self.limit = limit
        self.used = used
        self.retry_after_s = retry_after_s
        super().__init__(f"{reason} budget of {limit:g} spent ({used:g} used)")


def day_of(ts: float) -> int:
    return int(ts // DAY_S)


def month_of(ts: float) -> tuple[int, int]:
    t = time.gmtime(ts)
    return t.tm_year, t.tm_mon


def month_start(ts: float) -> float:
    y, m = month_of(ts)
    return float(calendar.timegm((y, m, 1, 0, 0, 0)))


def next_month_start(ts: float) -> float:
    y, m = month_of(ts)
    y, m = (y + 1, 1) if m == 12 else (y, m + 1)
    return float(calendar.timegm((y, m, 1, 0, 0, 0)))


@dataclass
class _Spent:
    day: int = -1
    tokens: float = 0.0
    requests: int = 0
    month: tuple = (0, 0)
    charge: float = 0.0
    inflight: int = 0


class BudgetBook:
    """Per-tenant spending of the current day and month (thread-safe)."""

    def __init__(self, budgets: dict[str, Budget], clock=time.time):
        self.budgets = {k: b for k, b in budgets.items() if b.any}
        self.clock = clock
        self._lock = threading.Lock()
        self._s: dict[str, _Spent] = {}
        # this server's rows not known to be committed: (tenant, tokens, charge,
        # future, day, month)
        self._pending: list = []

    def __bool__(self) -> bool:
        return bool(self.budgets)

    def load(self, store, commit_lock: threading.Lock | None = None) -> None:
        """Start from the ledger's hourly totals of the current day and month; called
        again every few seconds (``Ledger``: ``budget_refresh_s``), it takes in what
        other servers on the same database (replicas) have spent. This server's rows
        not yet committed are added to the database's totals. ``commit_lock`` is the
        writer's, held from a commit until its rows' futures are done: the totals are
        read and merged under it, so a row whose future is not done then was not in
        the totals, and no row counts twice or not at all (``settle`` puts a row in the
        pending list before it is queued, so none is committed before it is listed)."""
        if not self.budgets:
            return
        now = self.clock()
        day0_h = day_of(now) * DAY_S // 3600
        month0_h = int(month_start(now) // 3600)
        names = sorted(self.budgets)
        marks = ", ".join("?" * len(names))
        d, m = day_of(now), month_of(now)
        with commit_lock or contextlib.nullcontext():
            rows = store.query(
                "SELECT tenant, "
                "SUM(CASE WHEN hour >= ? THEN prompt_tokens + completion_tokens ELSE 0 END), "
                "SUM(CASE WHEN hour >= ? THEN requests ELSE 0 END), SUM(charge) "
                f"FROM usage_hourly WHERE hour >= ? AND tenant IN ({marks}) GROUP BY tenant",
                [day0_h, day0_h, month0_h, *names],
            )
            got = {t: (float(a or 0), int(b or 0), float(c or 0.0)) for t, a, b, c in rows}
            with self._lock:
                self._pending = [p for p in self._pending if not p[3].done()]
                for tenant in self.budgets:
                    s = self._fresh(tenant, now)
                    s.tokens, s.requests, s.charge = got.get(tenant, (0.0, 0, 0.0))
                    for t, tokens, charge, _, pd, pm in self._pending:
                        if t == tenant:
                            if pd == d:
                                s.tokens += tokens
                                s.requests += 1
                            if pm == m:
                                s.charge += charge

    def _fresh(self, tenant: str, now: float) -> _Spent:
        s = self._s.setdefault(tenant, _Spent())
        d, m = day_of(now), month_of(now)
        if s.day != d:
            s.day, s.tokens, s.requests = d, 0.0, 0
        if s.month != m:
            s.month, s.charge = m, 0.0
        return s

    def admit(self, tenant: str) -> bool:
        """Count a request in flight, or raise ``OverBudget``. Returns whether it was
        counted (False: the tenant has no budget), so the caller knows to ``settle``."""
        b = self.budgets.get(tenant)
        if b is None:
            return False
        now = self.clock()
        with self._lock:
            s = self._fresh(tenant, now)
            day_end = (day_of(now) + 1) * DAY_S
            if b.requests_per_day is not None and s.requests + s.inflight >= b.requests_per_day:
                raise OverBudget(
                    "requests_per_day", b.requests_per_day, s.requests + s.inflight, day_end - now
                )
            if b.tokens_per_day is not None and s.tokens >= b.tokens_per_day:
                raise OverBudget("tokens_per_day", b.tokens_per_day, s.tokens, day_end - now)
            if b.charge_per_month is not None and s.charge >= b.charge_per_month:
                raise OverBudget(
                    "charge_per_month", b.charge_per_month, s.charge, next_month_start(now) - now
                )
            s.inflight += 1
        return True

    def settle(
        self,
        tenant: str,
        admitted: bool,
        tokens: int,
        charge: float,
        finished: bool = False,
        record: Callable[[], Future] | None = None,
    ) -> Future | None:
        """A request admitted by ``admit`` has ended. ``finished``: it counts the
        request, its tokens and its charge; otherwise only its in-flight slot is given
        back. ``record`` (a finished request's row for the ledger) queues the row and
        returns its future; the row is listed as pending before it is queued, so it
        cannot be committed unlisted (see ``load``). Returns the row's future."""
        if tenant not in self.budgets:
            return None if record is None else record()
        now = self.clock()
        with self._lock:
            s = self._fresh(tenant, now)
            if admitted:
                s.inflight = max(0, s.inflight - 1)
            if not finished:
                return None if record is None else record()
            s.requests += 1
            s.tokens += tokens
            s.charge += charge
            if record is None:
                return None
            future = record()
            self._pending.append((tenant, tokens, charge, future, s.day, s.month))
            return future

    def spent(self, tenant: str) -> dict:
        with self._lock:
            s = self._fresh(tenant, self.clock())
            return {
                "tokens_today": s.tokens,
                "requests_today": s.requests,
                "in_flight": s.inflight,
                "charge_this_month": s.charge,
            }
