"""Per-request records and their summary (the stable result schema).

A request *attains* its SLO when it completed (finish reason ``stop`` or ``length``),
was not shed and had no error, its mean TPOT -- (finish - first token) / (output
tokens - 1) -- is within its TPOT target and its TTFT within its TTFT target (targets
that are None are not checked). Shed and failed requests count as violations.
``tpot_attained`` judges the TPOT target only: completed and mean TPOT within target,
TTFT ignored (a request that waited too long for its first token but then decoded
fast enough is TPOT-attained but not attained).

Summary ``M`` (overall and per class), see ``summarize``::

    requests, completed, shed, errors, attained, violations, attainment (0-1),
    tpot_attained, tpot_attainment (0-1; TPOT target only),
    throughput_tok_s, goodput_tok_s, request_throughput_rps, request_goodput_rps,
    input_tokens, output_tokens,
    ttft_ms / tpot_ms / itl_ms / e2e_ms: {"mean", "p50", "p95", "p99"} (None if empty),
    drafted_tokens, verified_tokens, accepted_tokens, rejected_tokens, acceptance_rate,
    rejected_flops_share (when FLOPs per token are given), degraded,
    tpot_target_ms / ttft_target_ms (mean over the class's requests)

ITL is the gap between successive deliveries of output: tokens committed in the same
iteration (or streamed in the same chunk) arrive together and form one delivery.
Percentiles use linear interpolation between order statistics (numpy's default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from adaserve.core.slo import COMPLETE_REASONS, slo_met


@dataclass
class RequestRecord:
    """Timings (seconds from the run's start) and counts of one request."""

    idx: int
    cls: str
    arrival_s: float
    first_token_s: float | None = None
    finish_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    output_tokens: int = 0
    tpot_target_ms: float | None = None
    ttft_target_ms: float | None = None
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    finish_reason: str | None = None
    shed: bool = False
    error: str | None = None
    degraded: bool = False
    steps: int | None = None  # decode iterations (None: derived from the counts)

    @classmethod
    def failed(cls, item, slo, err: str, shed: bool) -> RequestRecord:
        """The record of work item ``item`` that got no answer: shed (admission) or an
        error; ``slo`` (or None) gives its targets."""
        return cls(
            idx=item.idx,
            cls=item.cls,
            arrival_s=item.arrival_s,
            tpot_target_ms=slo.tpot_ms if slo else None,
            ttft_target_ms=slo.ttft_ms if slo else None,
            prompt_tokens=item.prompt_len,
            shed=shed,
            error=err,
        )

    @property
    def completed(self) -> bool:
        return not self.shed and self.error is None and self.finish_reason in COMPLETE_REASONS

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_s is None:
            return None
        return (self.first_token_s - self.arrival_s) * 1000.0

    @property
    def tpot_ms(self) -> float | None:
        if self.first_token_s is None or self.finish_s is None or self.output_tokens < 2:
            return None
        return (self.finish_s - self.first_token_s) * 1000.0 / (self.output_tokens - 1)

    @property
    def itl_ms(self) -> list[float]:
        t = self.token_times_s
        return [(b - a) * 1000.0 for a, b in zip(t, t[1:]) if b > a]

    @property
    def e2e_ms(self) -> float | None:
        if self.finish_s is None:
            return None
        return (self.finish_s - self.arrival_s) * 1000.0

    @property
    def tpot_attained(self) -> bool:
        """Completed with mean TPOT within its target (TTFT not checked)."""
        return slo_met(self.completed, self.tpot_ms, None, self.tpot_target_ms, None)

    @property
    def attained(self) -> bool:
        """The SLO met (``slo.slo_met``): completed, mean TPOT and TTFT within targets."""
        return slo_met(
            self.completed, self.tpot_ms, self.ttft_ms, self.tpot_target_ms, self.ttft_target_ms
        )

    @property
    def decode_steps(self) -> int:
        """Decode iterations: each yields its accepted candidates plus one token."""
        if self.steps is not None:
            return self.steps
        return max(0, self.output_tokens - 1 - self.accepted)

    def to_dict(self) -> dict:
        d = {name: getattr(self, name) for name in self.__dataclass_fields__}
        d["token_times_s"] = list(self.token_times_s)
        d.update(
            ttft_ms=self.ttft_ms,
            tpot_ms=self.tpot_ms,
            e2e_ms=self.e2e_ms,
            attained=self.attained,
            tpot_attained=self.tpot_attained,
        )
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


def dist(values) -> dict:
    """{"mean", "p50", "p95", "p99"} of ``values`` (None entries dropped)."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return {"mean": None, "p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(v, [50, 95, 99])
    return {"mean": float(v.mean()), "p50": float(p50), "p95": float(p95), "p99": float(p99)}


def _mean(values) -> float | None:
    v = [x for x in values if x is not None]
    return float(sum(v) / len(v)) if v else None


def record_flops(r: RequestRecord, ft: float, fd: float) -> tuple[float, float]:
    """(total, rejected-candidate) FLOPs of one request.

    Target: prompt + one root per decode step + every verified candidate. Draft (when
    it drafted anything): prompt + output tokens it caches + every drafted candidate.
    Rejected: verified-but-rejected candidates (target) and drafted candidates that
    were not accepted (draft).
    """
    target = ft * (r.prompt_tokens + r.decode_steps + r.verified)
    draft = fd * (r.prompt_tokens + r.output_tokens + r.drafted) if r.drafted else 0.0
    rejected = ft * max(0, r.verified - r.accepted) + fd * max(0, r.drafted - r.accepted)
    return target + draft, rejected


def _metrics(records: list[RequestRecord], duration_s: float, flops) -> dict:
    done = [r for r in records if r.completed]
    good = [r for r in done if r.attained]
    tpot_good = sum(1 for r in done if r.tpot_attained)
    n = len(records)
    dur = duration_s if duration_s and duration_s > 0 else float("nan")
    out_tok = sum(r.output_tokens for r in done)
    good_tok = sum(r.output_tokens for r in good)
    itl: list[float] = []
    for r in done:
        itl.extend(r.itl_ms)
    verified = sum(r.verified for r in records)
    accepted = sum(r.accepted for r in records)
    m = {
        "requests": n,
        "completed": len(done),
        "shed": sum(1 for r in records if r.shed),
        "errors": sum(1 for r in records if r.error is not None and not r.shed),
        "attained": len(good),
        "violations": n - len(good),
        "attainment": len(good) / n if n else None,
        "tpot_attained": tpot_good,
        "tpot_attainment": tpot_good / n if n else None,
        "throughput_tok_s": _finite(out_tok / dur),
        "goodput_tok_s": _finite(good_tok / dur),
        "request_throughput_rps": _finite(len(done) / dur),
        "request_goodput_rps": _finite(len(good) / dur),
        "input_tokens": sum(r.prompt_tokens for r in done),
        "cached_input_tokens": sum(r.cached_tokens for r in done),
        "prefix_hit_rate": _finite(
            sum(r.cached_tokens for r in done) / max(1, sum(r.prompt_tokens for r in done))
        ),
        "output_tokens": out_tok,
        "ttft_ms": dist(r.ttft_ms for r in done),
        "tpot_ms": dist(r.tpot_ms for r in done),
        "itl_ms": dist(itl),
        "e2e_ms": dist(r.e2e_ms for r in done),
        "drafted_tokens": sum(r.drafted for r in records),
        "verified_tokens": verified,
        "accepted_tokens": accepted,
        "rejected_tokens": max(0, verified - accepted),
        "acceptance_rate": accepted / verified if verified else None,
        "degraded": sum(1 for r in records if r.degraded),
        "tpot_target_ms": _mean(r.tpot_target_ms for r in records),
        "ttft_target_ms": _mean(r.ttft_target_ms for r in records),
    }
    if flops is not None:
        ft, fd = flops
        tot = rej = 0.0
        for r in records:
            a, b = record_flops(r, ft, fd)
            tot += a
            rej += b
        m["flops"] = tot
        m["rejected_flops"] = rej
        m["rejected_flops_share"] = rej / tot if tot else None
    return m


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def summarize(
    records: list[RequestRecord],
    duration_s: float,
    extra: dict | None = None,
    *,
    flops_per_token: tuple[float, float] | None = None,
    class_extra: dict[str, dict] | None = None,
) -> dict:
    """``{"overall": M, "per_class": {CLASS: M}}``; ``extra`` is merged into overall.

    ``duration_s`` is the wall time the throughputs are divided by (the benchmark's
    duration). ``flops_per_token`` = (target, draft) FLOPs per token enables the
    rejected-FLOPs share. ``class_extra`` {CLASS: {...}} is merged into that class's
    M (and an ``"overall"`` entry into overall): e.g. ``energy_j`` and
    ``energy_per_token_j`` (``bench.extras.class_energy``).
    """
    classes: dict[str, list[RequestRecord]] = {}
    for r in records:
        classes.setdefault(r.cls, []).append(r)
    overall = _metrics(records, duration_s, flops_per_token)
    overall["duration_s"] = duration_s
    if extra:
        overall.update(extra)
    per_class = {c: _metrics(rs, duration_s, flops_per_token) for c, rs in sorted(classes.items())}
    for c, d in (class_extra or {}).items():
        target = overall if c == "overall" else per_class.get(c)
        if target is not None:
            target.update(d)
    return {"overall": overall, "per_class": per_class}


# ---------------------------------------------------------------------- shifts
def rolling_attainment(
    records: list[RequestRecord],
    cls: str | None,
    window_s: float,
    t_end: float,
    step_s: float | None = None,
    min_requests: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Attainment of ``cls`` requests (all when None) that ended in (t - window, t].

    Requests are placed at their finish time (shed/failed ones at arrival). Returns
    (times, values); windows with fewer than ``min_requests`` requests give NaN.
    """
    step_s = step_s or max(window_s / 10.0, 0.05)
    rs = [r for r in records if cls is None or r.cls == cls]
    at = np.asarray([r.finish_s if r.finish_s is not None else r.arrival_s for r in rs])
    ok = np.asarray([1.0 if r.attained else 0.0 for r in rs])
    times = np.arange(step_s, max(t_end, step_s) + 1e-9, step_s)
    vals = np.full(len(times), np.nan)
    for i, t in enumerate(times):
        sel = (at > t - window_s) & (at <= t)
        if sel.sum() >= min_requests:
            vals[i] = ok[sel].mean()
    return times, vals


def _attainment_between(records, cls, a: float, b: float) -> float | None:
    sel = [
        r
        for r in records
        if r.cls == cls and a <= (r.finish_s if r.finish_s is not None else r.arrival_s) <= b
    ]
    return sum(r.attained for r in sel) / len(sel) if sel else None


def shift_convergence(
    records: list[RequestRecord],
    shift_times: list[float],
    strict_cls: str,
    t_end: float,
    window_s: float = 5.0,
    tolerance: float = 0.05,
    min_requests: int = 3,
) -> list[dict]:
    """Controller convergence after each shift.

    For a shift at T (segment [T, T_next)): the strict class's steady state after the
    shift is its attainment over the segment's second half; ``convergence_s`` is the time
    from T until its rolling attainment (window ``window_s``, windows with fewer than
    ``min_requests`` requests skipped) stays within ``tolerance`` (5 points) of that
    steady state until the segment ends. ``pre_steady`` is the attainment over the
    second half of the previous segment, ``dip`` the lowest rolling value after T.
    """
    out = []
    bounds = sorted(shift_times)
    for i, T in enumerate(bounds):
        prev = bounds[i - 1] if i else 0.0
        end = bounds[i + 1] if i + 1 < len(bounds) else t_end
        pre = _attainment_between(records, strict_cls, (prev + T) / 2, T)
        post = _attainment_between(records, strict_cls, (T + end) / 2, end)
        times, vals = rolling_attainment(
            records, strict_cls, window_s, end, min_requests=min_requests
        )
        sel = times >= T
        times, vals = times[sel], vals[sel]
        conv = None
        dip = None
        if post is not None and len(times):
            valid = ~np.isnan(vals)
            if valid.any():
                dip = float(np.nanmin(vals))
            bad = valid & (np.abs(vals - post) > tolerance + 1e-12)
            if not valid.any():
                conv = None  # too few strict requests to tell
            elif not bad.any():
                conv = 0.0
            else:
                last_bad = int(np.nonzero(bad)[0][-1])
                if last_bad + 1 < len(times):
                    conv = float(times[last_bad + 1] - T)
        out.append(
            {
                "at_s": T,
                "pre_steady": pre,
                "post_steady": post,
                "dip": dip,
                "convergence_s": conv,
                "window_s": window_s,
            }
        )
    return out
