"""The SLO audit report behind ``GET /v1/slo/report``.

Per class: achieved TTFT and TPOT percentiles (p50/p95/p99, numpy's default linear
interpolation over the finished requests that have the value), attainment, goodput
and the verification capacity (tree nodes, FLOPs) its requests used. Per tenant:
usage and charges. The numbers are computed from the same per-request ``metrics``
objects that the responses carry, so a client can check them.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 95, 99)


@dataclass(frozen=True)
class Record:
    """One finished request (no prompt or output text)."""

    cls: str
    tenant: str
    reason: str
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    queue_ms: float | None
    attained: bool
    output_tokens: int
    tree_nodes: int
    accepted_tokens: int
    arrival: float
    finished_at: float
    degraded_from: str | None = None


def _pcts(values: list[float]) -> dict:
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None, "count": 0}
    a = np.asarray(values, dtype=np.float64)
    out = {f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}
    out["mean"] = float(a.mean())
    out["count"] = len(values)
    return out


class ReportStore:
    """Finished-request records (bounded) and shed counts; thread-safe."""

    def __init__(self, class_names, max_records: int = 200_000):
        self._lock = threading.Lock()
        self.class_names = list(class_names)
        self._records: deque[Record] = deque(maxlen=max_records)
        self._shed: dict[tuple[str, str], int] = {}
        self._rate_limited: dict[tuple[str, str], int] = {}
        self._counts: dict[str, list[int]] = {c: [0, 0] for c in self.class_names}
        # called with every new record (a replica of a cluster forwards them)
        self.on_record = None

    def record(self, rec: Record) -> None:
        with self._lock:
            self._records.append(rec)
            n = self._counts.setdefault(rec.cls, [0, 0])
            n[0] += 1
            n[1] += int(rec.attained)
        if self.on_record is not None:
            self.on_record(rec)

    def counts(self) -> tuple[dict, dict]:
        """Copies of the shed and rate-limited counts ({(class|tenant, reason): n})."""
        with self._lock:
            return dict(self._shed), dict(self._rate_limited)

    def add_counts(self, shed: dict, rate_limited: dict) -> None:
        """Add counts made elsewhere (another replica's ``counts``)."""
        with self._lock:
            for k, v in shed.items():
                self._shed[k] = self._shed.get(k, 0) + v
            for k, v in rate_limited.items():
                self._rate_limited[k] = self._rate_limited.get(k, 0) + v

    def shed(self, cls: str, reason: str) -> None:
        with self._lock:
            self._shed[(cls, reason)] = self._shed.get((cls, reason), 0) + 1

    def rate_limited(self, tenant: str, reason: str) -> None:
        with self._lock:
            k = (tenant, reason)
            self._rate_limited[k] = self._rate_limited.get(k, 0) + 1

    def attainment(self) -> dict[str, float]:
        """Class -> share of its finished requests that met their SLO (all time)."""
        with self._lock:
            return {c: (a / n if n else 0.0) for c, (n, a) in self._counts.items()}

    def rolling(self, now: float, window_s: float) -> dict[str, dict]:
        """Class -> requests, attained and attainment (None without requests) of the
        requests that finished in the last ``window_s`` seconds before ``now`` (the
        clock of ``Record.finished_at``: the engine's)."""
        with self._lock:
            return rolling_counts(self._records, self.class_names, now, window_s)

    def build(
        self,
        *,
        class_targets: dict[str, dict],
        prices: dict[str, float],
        flops_per_token: float,
        usage: dict[str, dict],
        engine: dict,
        tenant: str | None = None,
    ) -> dict:
        """The report as a JSON-ready dict; ``tenant`` limits the per-tenant part."""
        with self._lock:
            recs = list(self._records)
            shed = dict(self._shed)
            limited = dict(self._rate_limited)
        if recs:
            t0 = min(r.arrival for r in recs)
            t1 = max(r.finished_at for r in recs)
            window = max(t1 - t0, 1e-9)
        else:
            window = 0.0
        total_nodes = sum(r.tree_nodes for r in recs)
        classes = {}
        for name in self.class_names + sorted({r.cls for r in recs} - set(self.class_names)):
            rs = [r for r in recs if r.cls == name]
            n = len(rs)
            attained = sum(r.attained for r in rs)
            good = sum(r.output_tokens for r in rs if r.attained)
            nodes = sum(r.tree_nodes for r in rs)
            classes[name] = {
                "requests": n,
                "attained": attained,
                "attainment": attained / n if n else None,
                "finish_reasons": _count(r.reason for r in rs),
                # served here though they asked for a stricter class / asked for this
                # class and were served in a looser one
                "degraded_in": sum(r.degraded_from is not None for r in rs),
                "degraded_out": sum(r.degraded_from == name for r in recs),
                "shed": {k[1]: v for k, v in shed.items() if k[0] == name},
                "targets": class_targets.get(name, {}),
                "price_per_1k": prices.get(name),
                "ttft_ms": _pcts([r.ttft_ms for r in rs if r.ttft_ms is not None]),
                "tpot_ms": _pcts([r.tpot_ms for r in rs if r.tpot_ms is not None]),
                "queue_ms": _pcts([r.queue_ms for r in rs if r.queue_ms is not None]),
                "e2e_ms": _pcts([r.e2e_ms for r in rs if r.e2e_ms is not None]),
                "output_tokens": sum(r.output_tokens for r in rs),
                "goodput_tokens": good,
                "goodput_tokens_per_s": good / window if window else 0.0,
                "verification": {
                    "tree_nodes": nodes,
                    "accepted_tokens": sum(r.accepted_tokens for r in rs),
                    "share": nodes / total_nodes if total_nodes else 0.0,
                    "target_flops": nodes * flops_per_token,
                },
            }
        tenants = {}
        for name, u in usage.items():
            if tenant is not None and name != tenant:
                continue
            tenants[name] = dict(u)
            tenants[name]["rate_limited"] = {k[1]: v for k, v in limited.items() if k[0] == name}
        return {
            "object": "slo_report",
            "window_s": window,
            "requests": len(recs),
            "classes": classes,
            "tenants": tenants,
            "engine": engine,
        }


def rolling_counts(records, class_names, now: float, window_s: float) -> dict[str, dict]:
    """``ReportStore.rolling`` of ``records`` (a sequence in the order the requests
    finished: newest last)."""
    since = now - window_s
    out = {c: [0, 0] for c in class_names}
    for r in reversed(records):
        if r.finished_at < since:
            break
        n = out.setdefault(r.cls, [0, 0])
        n[0] += 1
        n[1] += int(r.attained)
    return rolling_rates(out)


def rolling_rates(counts: dict[str, list[int]]) -> dict[str, dict]:
    """{class: [requests, attained]} -> ``rolling``'s dicts."""
    return {
        c: {"requests": n, "attained": a, "attainment": a / n if n else None}
        for c, (n, a) in counts.items()
    }


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out
