"""Arrival times of a workload: a gamma renewal process or a trace file's timestamps.

Arrivals: gamma-distributed gaps with shape ``burstiness`` and mean ``1/rate``
(``burstiness`` = 1 is a Poisson process; < 1 is burstier; coefficient of variation
``1/sqrt(burstiness)``), or the timestamps of a trace file rescaled to the requested
mean rate (the Azure LLM inference trace CSV format is accepted).

Shipped traces, by name (``--trace azure-conv``): the Azure LLM inference trace 2023,
conversation and coding services (``adaserve/assets/traces``, CC-BY 4.0; its README
there gives the attribution, which every report built from it repeats).
"""

from __future__ import annotations

import csv
import datetime as _dt
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from adaserve.bench.workload_spec import WorkloadError


def gamma_arrivals(
    rng: np.random.Generator,
    rate: float,
    burstiness: float,
    duration_s: float | None,
    num: int | None,
    rate_changes: list[tuple[float, float]] | None = None,
) -> np.ndarray:
    """Arrival times (s) of a gamma renewal process; ``rate_changes`` = [(t, rate)]."""
    if math.isinf(rate):
        return np.zeros(int(num or 0))
    changes = sorted(rate_changes or [])
    out: list[float] = []
    t = 0.0
    limit = num if num is not None else 10_000_000
    while len(out) < limit:
        r = rate
        for at, new in changes:
            if t >= at:
                r = new
        t += float(rng.gamma(burstiness, 1.0 / (r * burstiness)))
        if duration_s is not None and t >= duration_s:
            break
        out.append(t)
    return np.asarray(out, dtype=float)


# --trace names of the traces shipped in the package (adaserve.util.paths.TRACES)
NAMED_TRACES = {
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "azure-code": "AzureLLMInferenceTrace_code.csv",
}


def trace_path(trace: str | Path) -> Path:
    """The file of ``trace``: a shipped trace's name (``NAMED_TRACES``) or a path."""
    from adaserve.util.paths import TRACES

    name = str(trace)
    if name in NAMED_TRACES:
        return TRACES / NAMED_TRACES[name]
    p = Path(trace)
    if not p.exists() and p.parent == Path(".") and not p.suffix:
        raise WorkloadError(
            f"no trace file {name!r}; the shipped traces are {', '.join(NAMED_TRACES)}"
        )
    return p


def _parse_timestamp(s: str) -> float:
    """Seconds since the epoch of ``YYYY-MM-DD HH:MM:SS[.fffffff]`` (7 digits allowed)."""
    s = s.strip()
    date, _, clock = s.partition(" ") if " " in s else s.partition("T")
    hms, _, frac = clock.partition(".")
    d = _dt.datetime.fromisoformat(f"{date} {hms}").replace(tzinfo=_dt.timezone.utc)
    return d.timestamp() + (float(f"0.{frac}") if frac else 0.0)


@dataclass(frozen=True)
class TraceRows:
    times_s: np.ndarray  # seconds from the first row
    context_tokens: np.ndarray | None
    generated_tokens: np.ndarray | None


def load_trace(path: str | Path) -> TraceRows:
    """Read a trace: a shipped trace's name (``NAMED_TRACES``), an Azure LLM inference CSV
    (``TIMESTAMP,ContextTokens,GeneratedTokens``), a CSV with an ``arrival_s``/``timestamp``
    column, or one arrival time (s) per line."""
    p = trace_path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise WorkloadError(f"cannot read trace {path}: {e}") from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise WorkloadError(f"trace {path} is empty")
    head = lines[0].lower()
    times: list[float] = []
    ctx: list[int] = []
    gen: list[int] = []
    try:
        if any(c.isalpha() for c in head):
            rows = list(csv.DictReader(lines))
            keys = {k.lower(): k for k in rows[0]} if rows else {}
            tkey = keys.get("timestamp") or keys.get("arrival_s") or keys.get("arrival_time")
            if tkey is None:
                raise WorkloadError(f"trace {path}: no TIMESTAMP / arrival_s column")
            ckey, gkey = keys.get("contexttokens"), keys.get("generatedtokens")
            for row in rows:
                v = row[tkey].strip()
                try:
                    times.append(float(v))
                except ValueError:
                    times.append(_parse_timestamp(v))
                if ckey and gkey:
                    ctx.append(int(row[ckey]))
                    gen.append(int(row[gkey]))
        else:
            times = [float(ln.split(",")[0]) for ln in lines]
    except (ValueError, KeyError) as e:
        raise WorkloadError(f"trace {path}: malformed row ({e})") from None
    order = np.argsort(np.asarray(times), kind="stable")
    t = np.asarray(times, dtype=float)[order]
    t = t - t[0]
    c = np.asarray(ctx)[order] if ctx else None
    g = np.asarray(gen)[order] if gen else None
    return TraceRows(t, c, g)


def trace_arrivals(
    rows: TraceRows, rate: float, duration_s: float | None, num: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """The first N trace arrivals, time-scaled so that their window has mean ``rate``.

    N = ``num`` and/or ``round(rate * duration_s)`` (the smaller). The window ends at the
    (N+1)-th arrival, mapped to ``N / rate`` seconds, so the pattern (bursts, lulls) is
    the trace's and the mean rate is the requested one. A trace shorter than N rows is
    repeated. Returns (times, row indices into ``rows``).
    """
    t = rows.times_s
    if len(t) < 2 or t[-1] <= 0:
        raise WorkloadError("trace needs at least two distinct timestamps")
    counts = [num] if num is not None else []
    if duration_s is not None and not math.isinf(rate):
        counts.append(max(1, round(rate * duration_s)))
    n = min(counts)
    if math.isinf(rate):
        return np.zeros(n), np.arange(n) % len(t)
    period = t[-1] + t[-1] / (len(t) - 1)
    reps = -(-(n + 1) // len(t))
    tiled = np.concatenate([t + k * period for k in range(reps)])
    scale = (n / rate) / tiled[n]
    return tiled[:n] * scale, np.arange(n) % len(t)
