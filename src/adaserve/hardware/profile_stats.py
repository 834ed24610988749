"""Turning repeated latency samples into a profile the planner can trust (no torch).

``time_points`` runs a set of timers round-robin (every repeat visits every point
before any point is timed again), so a burst of load on a shared machine spreads over
all the token counts instead of landing on one of them, and repeats the points whose
median is not yet precise (``MEDIAN_PRECISION``; the cheap passes, whose relative spread
is the widest, get most of the repeats). ``summarize`` takes each
point's median, enforces that the medians never decrease with the token count, and
keeps the spread (10th and 90th percentiles) for the cache file. ``check_profile``
compares a measured profile with what the model's weight bytes and FLOPs allow on the
host and flags a profile that cannot be right.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# the precision a profile point's median is measured to: the 95% interval of the median
# within +-5% of it (on this project's 2-core machine a one-token pass's samples spread
# -10% / +40% around their median, so five samples put the median anywhere in a 30-70%
# band: three profiles in a row measured a two-token verification at 15.8, 10.3 and 9.0 ms)
MEDIAN_PRECISION = 0.05
# the time the repeats of imprecise points may take, in units of the ``reps`` rounds'
# time: the cheap (small) passes take them, whose relative spread is the widest, and a
# profile takes at most twice as long as its rounds alone
EXTRA_TIME = 1.0


def median_interval(xs: Sequence[float]) -> tuple[float, float]:
    """The distribution-free 95% interval of the median of ``xs`` (order statistics:
    ranks n/2 -+ 0.98 sqrt(n), clipped to the sample)."""
    s = sorted(xs)
    n = len(s)
    half = 0.98 * math.sqrt(n)
    lo = max(0, round(n / 2 - half) - 1)
    hi = min(n - 1, round(1 + n / 2 + half) - 1)
    return s[lo], s[hi]


def imprecise(xs: Sequence[float], precision: float = MEDIAN_PRECISION) -> bool:
    """Whether the median of ``xs`` is not yet known to +-``precision`` of itself."""
    lo, hi = median_interval(xs)
    return (hi - lo) / 2 > precision * abs(statistics.median(xs))


def time_points(
    timers: Sequence[Callable[[], float]],
    reps: int,
    extra_time: float = EXTRA_TIME,
    precision: float = MEDIAN_PRECISION,
) -> list[list[float]]:
    """Samples (ms) of each timer: one warm-up call each, then ``reps`` rounds in which
    every timer is called once, in order (interleaved, never all repeats of one point
    in a row), then more rounds over the points whose median is not yet known to
    ``precision`` (``imprecise``), still interleaved, until none is or they have taken
    ``extra_time`` x the first rounds' time (by the timers' own ms)."""
    if reps < 1:
        raise ValueError("reps must be at least 1")
    for t in timers:
        t()
    samples: list[list[float]] = [[] for _ in timers]
    for _ in range(reps):
        for i, t in enumerate(timers):
            samples[i].append(float(t()))
    budget = extra_time * sum(map(sum, samples))
    while budget > 0:
        todo = [i for i, xs in enumerate(samples) if imprecise(xs, precision)]
        if not todo:
            break
        for i in todo:
            samples[i].append(float(timers[i]()))
            budget -= samples[i][-1]
    return samples


def _quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` by linear interpolation between order statistics."""
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def monotone(medians: Sequence[float]) -> list[float]:
    """``medians`` (ordered by increasing token count) made non-decreasing by a suffix
    minimum: each point becomes the least of itself and every larger point.

    A pass over more tokens never costs less than one over fewer, so a point above a
    larger one was inflated; load only ever adds time, so the lower value is the one
    to believe (an isotonic mean would instead spread the inflated value over its
    neighbours)."""
    out = list(medians)
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return out


@dataclass(frozen=True)
class PointStats:
    """Per-point summary of repeated samples (ms), ordered by token count.

    median:     the monotone (non-decreasing) medians the profile uses
    raw_median: the medians as measured, before the monotone correction
    p10 / p90:  each point's 10th and 90th percentile (the measurement's spread)
    reps:       samples per point (the fewest of any point)
    reps_by_point: each point's samples (``time_points`` repeats an imprecise one)
    """

    median: tuple[float, ...]
    raw_median: tuple[float, ...]
    p10: tuple[float, ...]
    p90: tuple[float, ...]
    reps: int
    reps_by_point: tuple[int, ...] = ()

    def spread(self) -> dict:
        """The cache file's record of the measurement: raw medians, p10, p90, reps."""
        r = lambda xs: [round(x, 4) for x in xs]  # noqa: E731
        return {
            "raw_median_ms": r(self.raw_median),
            "p10_ms": r(self.p10),
            "p90_ms": r(self.p90),
            "reps": self.reps,
            "reps_by_point": list(self.reps_by_point),
        }


def summarize(samples: Sequence[Sequence[float]]) -> PointStats:
    """Medians (made monotone), raw medians and spread of each point's samples."""
    if not samples or any(len(s) == 0 for s in samples):
        raise ValueError("every point needs at least one sample")
    raw = [statistics.median(s) for s in samples]
    return PointStats(
        median=tuple(monotone(raw)),
        raw_median=tuple(raw),
        p10=tuple(_quantile(s, 0.1) for s in samples),
        p90=tuple(_quantile(s, 0.9) for s in samples),
        reps=min(len(s) for s in samples),
        reps_by_point=tuple(len(s) for s in samples),
    )


@dataclass(frozen=True)
class SanityLimits:
    """Generous ceilings of a host, for a lower bound on any forward pass.

    bandwidth_gbs:   memory bandwidth (GB/s); a pass reads every weight at least once,
                     so it takes at least weight bytes / bandwidth
    peak_tflops:     compute (TFLOP/s); a pass over n tokens does 2 x params x n FLOPs
    inversion_ratio: a 1-token pass measured this many times slower than the
                     largest pass is flagged (measured under load)
    """

    bandwidth_gbs: float = 1000.0
    peak_tflops: float = 50.0
    inversion_ratio: float = 1.5

    def __post_init__(self) -> None:
        for n in ("bandwidth_gbs", "peak_tflops"):
            v = getattr(self, n)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"{n} must be a positive number")
        if not self.inversion_ratio > 1:
            raise ValueError("inversion_ratio must be > 1")

    @classmethod
    def for_device(cls, device: str) -> SanityLimits:
        """Limits no current host of that kind exceeds: a CPU at 1 TB/s and 50 TFLOP/s,
        a GPU at 20 TB/s and 5 PFLOP/s."""
        if device.startswith("cuda"):
            return cls(bandwidth_gbs=20000.0, peak_tflops=5000.0)
        return cls()

    def floor_ms(self, params: int, bytes_per_param: float, tokens: float) -> float:
        """The least time (ms) a pass over ``tokens`` tokens of a ``params`` model can
        take: the larger of the weight-read time and the compute time."""
        read = params * bytes_per_param / (self.bandwidth_gbs * 1e9)
        compute = 2.0 * params * tokens / (self.peak_tflops * 1e12)
        return 1000.0 * max(read, compute)


def check_curve(
    name: str,
    tokens: Sequence[float],
    raw_ms: Sequence[float],
    params: int,
    bytes_per_param: float,
    limits: SanityLimits,
) -> tuple[list[str], list[str]]:
    """(impossible, suspicious) findings on one measured curve (raw medians, ms):
    impossible = a point below the roofline floor; suspicious = the smallest pass
    measured ``inversion_ratio`` times slower than the largest."""
    impossible, suspicious = [], []
    for t, ms in zip(tokens, raw_ms):
        floor = limits.floor_ms(params, bytes_per_param, t)
        if ms < floor:
            impossible.append(
                f"{name}: {ms:.4g} ms for {t:g} tokens is below the roofline floor "
                f"{floor:.4g} ms ({params} params at {limits.bandwidth_gbs:g} GB/s, "
                f"{limits.peak_tflops:g} TFLOP/s)"
            )
    if len(raw_ms) > 1 and raw_ms[0] > limits.inversion_ratio * raw_ms[-1]:
        suspicious.append(
            f"{name}: {tokens[0]:g} token(s) took {raw_ms[0]:.4g} ms but {tokens[-1]:g} took "
            f"{raw_ms[-1]:.4g} ms (inverted: measured under load?)"
        )
    return impossible, suspicious


def check_profile(prof: dict, limits: SanityLimits) -> dict:
    """``{"impossible": [...], "suspicious": [...]}`` of a measured profile dict (as
    ``adaserve.engine.profile.measure`` writes it: raw medians under each curve's
    ``"spread"``, parameter counts and ``"bytes_per_param"``)."""
    impossible: list[str] = []
    suspicious: list[str] = []
    bpp = float(prof.get("bytes_per_param", 4))
    v = prof["verify"]
    for kv, spread in (v.get("spread_by_kv") or {}).items():
        a, b = check_curve(
            f"verify at KV {kv}",
            v["tokens"],
            spread["raw_median_ms"],
            int(prof["target"]["params"]),
            bpp,
            limits,
        )
        impossible += a
        suspicious += b
    d = prof.get("draft_step")
    if d and "spread" in d and prof.get("draft"):
        a, b = check_curve(
            "draft step",
            d["tokens"],
            d["spread"]["raw_median_ms"],
            int(prof["draft"]["params"]),
            bpp,
            limits,
        )
        impossible += a
        suspicious += b
    suspicious += check_step(prof)
    return {"impossible": impossible, "suspicious": suspicious}


# a whole decode step may cost this many one-token passes plus this many ms of host
# work before its overhead is flagged (on the shipped CPU pair a step is about 1.2
# one-token passes; a start on a busy machine once cached 1,075 ms of "overhead")
STEP_PASSES, STEP_HOST_MS = 2.0, 5.0


def check_step(prof: dict) -> list[str]:
    """Suspicious findings on the measured decode step: a whole iteration of one
    request should cost about one one-token verification plus a little host work;
    one measured at over ``STEP_PASSES`` passes plus ``STEP_HOST_MS`` was measured
    while the machine was busy, and its overhead would be wrong. Likewise the host's
    work per request of a step (``overhead_ms_per_request``) above a whole one-token
    verification."""
    step = prof.get("decode_step_ms")
    v = prof.get("verify") or {}
    spread = (v.get("spread_by_kv") or {}).get(str((v.get("kv_len") or [None])[0]))
    if step is None or not spread or not v.get("tokens") or v["tokens"][0] != 1:
        return []
    one = float(spread["raw_median_ms"][0])
    found = []
    if float(step) > STEP_PASSES * one + STEP_HOST_MS:
        found.append(
            f"decode step: {float(step):.4g} ms for one request, but a one-token verification "
            f"took {one:.4g} ms (over {STEP_PASSES:g}x + {STEP_HOST_MS:g} ms: the step "
            "overhead was measured under load?)"
        )
    # a request's share of the host's work cannot cost more than a whole pass of it
    per_request = float(prof.get("overhead_ms_per_request") or 0.0)
    if per_request > one:
        found.append(
            f"host work per request: {per_request:.4g} ms, more than a one-token "
            f"verification ({one:.4g} ms): measured under load?"
        )
    return found
