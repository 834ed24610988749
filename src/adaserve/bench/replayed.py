"""Each request's TPOT with the engine's own passes at the simulator's prices.

Issue 30's per-request fidelity check: a run's passes are replayed as the engine ran
them (the same batches, trees and accepted tokens), each at the profile's price of it
(``StepTrace.predicted_ms``: ``hardware.drift.predicted_pass_ms``, the function the
simulator's clock advances by), back to back as the simulator runs them. A request's
replayed TPOT is the priced passes after its first token's pass up to its last token's,
over its tokens less one. Against its measured TPOT that tests the model of the engine
request by request: each pass's price, and the host time between passes the simulator
does not have.

``at_speed`` is the same with every price scaled by the run's median measured over
predicted pass time: the machine's speed during the run, which a profile measured
minutes earlier does not know (a simulator replaying the run's speed trace has it).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import accumulate
from statistics import median

from adaserve.bench.metrics import RequestRecord

TOLERANCE = 0.10  # issue 30: each request's replayed TPOT within 10% of the engine's
_SAME_TIME_S = 1e-6  # a token's stamp is its pass's commit time (``StepTrace.t_end``)


def replayed_tpot(
    records: Sequence[RequestRecord],
    passes: Sequence[tuple[float, float, float]],
    tolerance: float = TOLERANCE,
) -> dict | None:
    """The replay's summary over the completed requests of a run, or None when no pass
    was priced (no profile) or no request had two token times.

    ``passes``: ``(t_start, t_end, predicted_ms)`` of every pass in order, on the
    records' time base (``token_times_s``). Returns ``n`` (requests compared), the
    quantiles of replayed over measured TPOT (``ratio``: p10 / p50 / p90), ``within``
    (the share within ``tolerance``), ``speed`` (the run's median measured over
    predicted pass time), ``within_at_speed``, ``between_passes`` (the median share of a
    request's decode time spent between passes) and ``within_by_class``."""
    priced = [(e - s) * 1000.0 / p for s, e, p in passes if p > 0]
    if not priced:
        return None
    speed = median(priced)
    ends = [e for _, e, _ in passes]
    cum_price = [0.0, *accumulate(p for _, _, p in passes)]
    cum_run = [0.0, *accumulate((e - s) * 1000.0 for s, e, _ in passes)]
    cum_unpriced = [0, *accumulate(int(p <= 0) for _, _, p in passes)]

    def at(t: float) -> int | None:
        """The index of the pass that committed at ``t``."""
        k = bisect.bisect_left(ends, t - _SAME_TIME_S)
        return k if k < len(ends) and abs(ends[k] - t) <= _SAME_TIME_S else None

    rows: list[tuple[str, float, float, float]] = []  # class, ratio, at speed, in passes
    for r in records:
        t = r.token_times_s
        if not r.completed or len(t) < 2 or t[-1] <= t[0]:
            continue
        i, j = at(t[0]), at(t[-1])
        if i is None or j is None or cum_unpriced[j + 1] != cum_unpriced[i + 1]:
            continue
        measured = (t[-1] - t[0]) * 1000.0
        replay = cum_price[j + 1] - cum_price[i + 1]  # passes i+1 .. j, back to back
        ran = cum_run[j + 1] - cum_run[i + 1]
        rows.append((r.cls, replay / measured, replay * speed / measured, ran / measured))
    if not rows:
        return None

    def share(vals) -> float:
        vals = list(vals)
        return sum(abs(v - 1.0) <= tolerance for v in vals) / len(vals)

    ratios = sorted(x[1] for x in rows)

    def q(f: float) -> float:
        return round(ratios[min(len(ratios) - 1, int(f * len(ratios)))], 4)

    classes = sorted({c for c, *_ in rows})
    return {
        "n": len(rows),
        "tolerance": tolerance,
        "ratio": {"p10": q(0.1), "p50": q(0.5), "p90": q(0.9)},
        "within": round(share(x[1] for x in rows), 4),
        "speed": round(speed, 4),
        "within_at_speed": round(share(x[2] for x in rows), 4),
        "between_passes": round(1.0 - median(x[3] for x in rows), 4),
        "within_by_class": {c: round(share(x[1] for x in rows if x[0] == c), 4) for c in classes},
        "within_at_speed_by_class": {
            c: round(share(x[2] for x in rows if x[0] == c), 4) for c in classes
        },
    }


def replayed_line(pol: str, overall: dict) -> str | None:
    """One line of a bench summary: the replay's figures of ``pol`` (one run's, or each
    run's when repeated); None when there are none."""
    rt = overall.get("replayed_tpot")
    if rt:
        return (
            f"{pol} within {100 * rt['tolerance']:.0f}% for {100 * rt['within']:.0f}% of "
            f"{rt['n']} requests (at the run's speed {rt['speed']:.2f}x: "
            f"{100 * rt['within_at_speed']:.0f}%), replayed / measured p50 "
            f"{rt['ratio']['p50']:.2f}, between passes {100 * rt['between_passes']:.0f}%"
        )
    reps = [r.get("replayed") for r in overall.get("repeats") or []]
    if not any(reps):
        return None

    def per(key: str) -> str:
        return " / ".join("-" if x is None else f"{100 * x[key]:.0f}" for x in reps)

    tol = next(x for x in reps if x).get("tolerance", TOLERANCE)
    return (
        f"{pol} within {100 * tol:.0f}% per run {per('within')}% of requests "
        f"(at each run's speed {per('within_at_speed')}%)"
    )
