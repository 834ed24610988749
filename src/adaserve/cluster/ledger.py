"""The state the replicas of one service share (plain Python; ``serve_app`` runs it as
one named Ray actor): tenant quotas, every replica's latest report, and the drain flag.

Quotas are the single server's ``QuotaBook``, held once for the whole service, so a
tenant's requests per minute, tokens per minute and concurrency hold across replicas.
A replica asks twice per request, as the single server does: at its headers
(``enter``: requests per minute and a concurrency slot) and once its prompt is
tokenised (``admit``: the prompt and the output reservation), and hands back what it did not use in batches (``settle``): the
actor is called per request, never per token.

Reports: every replica pushes, a few times a second, its Prometheus text, its new
finished-request records, its new iteration samples and its counts (``push``); the
front door reads them all (``snapshots``) to answer ``/metrics``, ``/v1/slo/report``
and the dashboard's data for the whole service. A replica that has not pushed for
``stale_s`` is taken for dead: its gauges are dropped, its counters and records kept
(they happened), the concurrency slots its requests held are given back to their
tenants, and so is the part of their output reservations they had not used: what the
ledger reserved for the replica and has not seen settled, less the tokens its requests
in flight had produced by its last push (``inflight_tokens`` in the report). The tenant
is charged for what was produced up to a push period before the replica died, never
for output it did not get.

Interrupted streams: the front door reports (``interrupted``) a stream a replica broke
off, with the output tokens it had already relayed to the client. Once that replica is
taken for dead they are usage (``interrupted`` in its snapshot: tenant, class, one
request, its prompt and those completion tokens at the class's price), which the
report adds to the tenant's; if the replica goes on pushing instead, it is alive and
accounts the request itself (an aborted request is usage too), and the claim is dropped.
"""

from __future__ import annotations

import time
from collections import deque

from adaserve.server.config import Tenant
from adaserve.server.errors import ApiError
from adaserve.server.quotas import QuotaBook
from adaserve.server.usage import UsageBook

LEDGER_NAME = "adaserve-ledger"


def error_tuple(e: ApiError) -> tuple:
    """An ``ApiError`` as plain data (to cross a process boundary)."""
    return (e.status, e.message, e.param, e.type, e.code, dict(e.headers), e.reason)


def error_of(t: tuple) -> ApiError:
    status, message, param, type_, code, headers, reason = t
    return ApiError(status, message, param, type=type_, code=code, headers=headers, reason=reason)


class Ledger:
    """Quotas, replica reports and the drain flag of one service (see module doc)."""

    def __init__(
        self,
        tenants: tuple[Tenant, ...],
        stale_s: float = 5.0,
        max_records: int = 200_000,
        max_samples: int = 600,
        clock=time.monotonic,
    ):
        self.tenants = {t.name: t for t in tenants}
        self.quotas = QuotaBook(tenants, clock=clock)
        self.clock = clock
        self.stale_s = stale_s
        self.reports: dict[str, dict] = {}
        self.records: dict[str, deque] = {}
        self.max_records = max_records
        self.samples: dict[str, deque] = {}
        self.max_samples = max_samples  # per replica, as a single server's IterationLog
        self.pushed_at: dict[str, float] = {}
        # concurrency slots held per (replica, tenant): given back if the replica dies
        self.held: dict[tuple[str, str], int] = {}
        # output tokens reserved per (replica, tenant) and not settled yet; what a dead
        # replica's in-flight requests had produced by its last push, per tenant; and
        # what was given back for a dead replica, for the settlements it may still send
        self.reserved: dict[tuple[str, str], int] = {}
        self.produced: dict[str, dict[str, int]] = {}
        self.forgiven: dict[tuple[str, str], int] = {}
        self.drain_grace_s: float | None = None
        # interrupted streams per replica: claims [(at, acct, tokens)] while it may be
        # alive, usage once it is dead
        self.claims: dict[str, list] = {}
        self.interrupted_usage: dict[str, UsageBook] = {}
        self.alive_after_s = 1.0  # a push this long after a claim: the replica lives
        self.class_targets: dict | None = None  # the deployment's targets record

    # ------------------------------------------------------------------ targets
    def targets(self, replica_id: str, record: dict | None) -> dict | None:
        """The deployment's class targets record: the first a replica offered
        (``cluster.targets``), named by that replica; ``record`` is the caller's own."""
        if self.class_targets is None and record is not None:
            self.class_targets = {**record, "replica": replica_id}
        return self.class_targets

    # ------------------------------------------------------------------ quotas
    def enter(self, replica_id: str, tenant: str, settlements: list | None = None) -> tuple:
        """("ok",) with the tenant's request and concurrency slot taken, or ("error",
        error_tuple, seconds until a requests-per-minute refusal can end)."""
        self.settle(replica_id, settlements or [])
        self._forget_dead()
        t = self.tenants.get(tenant)
        if t is None:  # the anonymous tenant of open mode, or one without quotas
            return ("ok",)
        try:
            self.quotas.enter(t)
        except ApiError as e:
            wait = 0.0
            if e.reason == "requests_per_minute":
                wait = self.quotas.requests_wait(tenant)
            return ("error", error_tuple(e), wait)
        k = (replica_id, tenant)
        self.held[k] = self.held.get(k, 0) + 1
        return ("ok",)

    def admit(
        self,
        replica_id: str,
        tenant: str,
        prompt_tokens: int,
        outputs: list[int],
        fit: bool,
        settlements: list | None = None,
    ) -> tuple:
        """("ok", reserved max_tokens per choice) or ("error", error_tuple, 0) for a
        request that has ``enter``-ed."""
        self.settle(replica_id, settlements or [])
        self._forget_dead()
        t = self.tenants.get(tenant)
        if t is None:  # the anonymous tenant of open mode, or one without quotas
            return ("ok", list(outputs))
        try:
            reserved = self.quotas.admit(t, prompt_tokens, outputs, fit=fit)
        except ApiError as e:
            return ("error", error_tuple(e), 0.0)
        k = (replica_id, tenant)
        self.reserved[k] = self.reserved.get(k, 0) + sum(reserved)
        return ("ok", reserved)

    def settle(self, replica_id: str, settlements: list) -> None:
        """Apply a batch: ("release", tenant) ends a request's concurrency slot,
        ("settle", tenant, reserved, produced) gives back its unused reservation."""
        for s in settlements:
            if s[0] == "release":
                t = self.tenants.get(s[1])
                if t is None:
                    continue
                k = (replica_id, s[1])
                if self.held.get(k, 0) > 0:
                    self.held[k] -= 1
                    self.quotas.release(t)
            elif s[0] == "settle":
                k = (replica_id, s[1])
                if self.forgiven.get(k, 0) >= s[2]:
                    # its unused part was given back when the replica was taken for dead
                    self.forgiven[k] -= s[2]
                    continue
                self.reserved[k] = max(0, self.reserved.get(k, 0) - s[2])
                self.quotas.settle(s[1], s[2], s[3])

    def _forget_dead(self) -> None:
        now = self.clock()
        dead = {r for r, at in self.pushed_at.items() if now - at > self.stale_s}
        for rid in [r for r in self.claims if r in dead or r not in self.pushed_at]:
            book = self.interrupted_usage.setdefault(rid, UsageBook())
            for _, a, tokens in self.claims.pop(rid):
                if a.get("tenant") is None:
                    continue
                book.record(
                    a["tenant"],
                    a.get("cls") or "unknown",
                    int(a.get("prompt_tokens") or 0),
                    tokens,
                    float(a.get("price_per_1k") or 0.0),
                )
        for (rid, tenant), n in list(self.held.items()):
            if rid in dead and n:
                for _ in range(n):
                    self.quotas.release(self.tenants[tenant])
                self.held[(rid, tenant)] = 0
        for (rid, tenant), n in list(self.reserved.items()):
            if rid in dead and n:
                used = self.produced.get(rid, {}).get(tenant, 0)
                self.quotas.settle(tenant, n, min(used, n))
                self.forgiven[(rid, tenant)] = self.forgiven.get((rid, tenant), 0) + n
                self.reserved[(rid, tenant)] = 0

    def interrupted(self, replica_id: str, acct: dict, completion_tokens: int) -> None:
        """The front door's report of a stream ``replica_id`` broke off after relaying
        ``completion_tokens`` output tokens (``acct``: tenant, cls, price_per_1k,
        prompt_tokens); see the module doc."""
        claim = (self.clock(), dict(acct), max(0, int(completion_tokens)))
        self.claims.setdefault(replica_id, []).append(claim)
        self._forget_dead()

    # ------------------------------------------------------------------ reports
    def push(
        self,
        replica_id: str,
        report: dict,
        records: list,
        settlements: list,
        samples: list | None = None,
    ) -> dict:
        """A replica's latest report, its records and iteration samples since the last
        push; returns what the replica must do (``{"drain_grace_s": ...}`` once a drain
        has begun)."""
        self.settle(replica_id, settlements)
        now = self.clock()
        if replica_id in self.claims:  # alive well after the claim: it counts its own
            kept = [c for c in self.claims[replica_id] if now - c[0] <= self.alive_after_s]
            if kept:
                self.claims[replica_id] = kept
            else:
                del self.claims[replica_id]
        self._forget_dead()
        self.reports[replica_id] = report
        self.produced[replica_id] = dict(report.get("inflight_tokens") or {})
        self.pushed_at[replica_id] = self.clock()
        if records:
            q = self.records.setdefault(replica_id, deque(maxlen=self.max_records))
            q.extend(records)
        if samples:
            q = self.samples.setdefault(replica_id, deque(maxlen=self.max_samples))
            q.extend(samples)
        return {"drain_grace_s": self.drain_grace_s}

    def snapshots(self, samples: bool = False) -> dict:
        """{replica_id: {"live": bool, "age_s": seconds since its last push, "report":
        dict, "records": [...]}}, and its iteration ``samples`` when asked."""
        now = self.clock()
        self._forget_dead()
        out = {}
        for rid, rep in self.reports.items():
            age = now - self.pushed_at.get(rid, -1e18)
            out[rid] = {
                "live": age <= self.stale_s,
                "age_s": age,
                "report": rep,
                "records": list(self.records.get(rid, ())),
            }
            if samples:
                out[rid]["samples"] = list(self.samples.get(rid, ()))
            if rid in self.interrupted_usage:
                out[rid]["interrupted"] = self.interrupted_usage[rid].by_tenant()
        return out

    def live_replicas(self) -> list[str]:
        now = self.clock()
        return sorted(r for r, at in self.pushed_at.items() if now - at <= self.stale_s)

    # ------------------------------------------------------------------ drain
    def drain(self, grace_s: float) -> None:
        """Ask every replica to stop taking requests (they read it at their next push)."""
        self.drain_grace_s = float(grace_s)
