"""Figures across rounds: the mean and a 95% interval, and whether two policies differ.

``bench serve --repeat N`` / ``--seeds LIST`` runs every policy several times; each run
(one round on one seed's workload) gives one value of each figure (attainment, goodput,
...). This module, torch- and scipy-free, turns such per-run values into:

- ``mean_ci(values)``: ``{"mean", "ci95": [lo, hi] | None, "n"}``, the Student t
  interval with n - 1 degrees of freedom, mean ± t(0.975, n-1) · s / sqrt(n) (s the
  sample standard deviation). One value has no interval: ``ci95`` is None, never a
  zero-width one. None entries (a class absent from a run) are left out of n. The
  interval is not clipped to the figure's range (an attainment interval may pass 1).
- ``intervals_separated(a, b)``: two policies' values are *separated* when their 95%
  intervals do not overlap; overlapping intervals, or a policy without an interval
  (fewer than two values), are *not separated*.
- ``paired_difference(a, b)``: where the runs line up (the same round and seed for
  both policies, ``a[i]`` and ``b[i]``), the mean of the differences a - b with its 95%
  interval (``mean_ci`` of the differences); *separated* when that interval excludes
  0. Pairing removes what the two runs share (the workload, the machine's speed at the
  time), so it usually separates smaller differences than the intervals test, the
  more conservative one. The bench reports both.

The t quantiles: exact values for 1 to 30 degrees of freedom (``T975``), beyond that
the Cornish-Fisher expansion of the t quantile around the normal one (within 1e-7 of
the exact value for df > 30; it tends to the normal 1.959964).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# t(0.975, df) for df = 1..30 (two-sided 95%), to 9 digits
T975 = (
    12.706204736,
    4.302652730,
    3.182446305,
    2.776445105,
    2.570581836,
    2.446911851,
    2.364624252,
    2.306004135,
    2.262157163,
    2.228138852,
    2.200985160,
    2.178812830,
    2.160368656,
    2.144786688,
    2.131449546,
    2.119905299,
    2.109815578,
    2.100922040,
    2.093024054,
    2.085963447,
    2.079613845,
    2.073873068,
    2.068657610,
    2.063898562,
    2.059538553,
    2.055529439,
    2.051830516,
    2.048407142,
    2.045229642,
    2.042272456,
)
Z975 = 1.959963985  # the normal quantile the t quantiles tend to


def t975(df: int) -> float:
    """t(0.975, df), the two-sided 95% quantile of Student's t with ``df`` >= 1."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(T975):
        return T975[df - 1]
    z, n = Z975, float(df)  # Cornish-Fisher (Abramowitz & Stegun 26.7.5)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / n + g2 / n**2 + g3 / n**3 + g4 / n**4


def _values(values) -> list[float]:
    return [float(v) for v in values if v is not None and math.isfinite(v)]


def mean_ci(values) -> dict:
    """``{"mean", "ci95", "n"}`` of the per-run ``values`` (None and non-finite left
    out): the mean (None without values) and its 95% Student t interval ``[lo, hi]``
    (None with fewer than two values)."""
    v = _values(values)
    n = len(v)
    if n == 0:
        return {"mean": None, "ci95": None, "n": 0}
    mean = sum(v) / n
    if n < 2:
        return {"mean": mean, "ci95": None, "n": n}
    s = math.sqrt(sum((x - mean) ** 2 for x in v) / (n - 1))
    half = t975(n - 1) * s / math.sqrt(n)
    return {"mean": mean, "ci95": [mean - half, mean + half], "n": n}


def half_width(stat: dict) -> float | None:
    """Half the width of ``stat``'s interval (``mean_ci``'s dict); None without one."""
    ci = stat.get("ci95")
    return None if ci is None else (ci[1] - ci[0]) / 2


def intervals_separated(a, b) -> dict:
    """Whether two policies' per-run values ``a`` and ``b`` are separated: their 95%
    intervals do not overlap. ``{"separated", "a", "b"}`` with ``a``/``b`` their
    ``mean_ci``; not separated when either has no interval (fewer than two values)."""
    sa, sb = (x if isinstance(x, dict) else mean_ci(x) for x in (a, b))
    ca, cb = sa["ci95"], sb["ci95"]
    sep = ca is not None and cb is not None and (ca[1] < cb[0] or cb[1] < ca[0])
    return {"separated": sep, "a": sa, "b": sb}


def paired_difference(a: Sequence, b: Sequence) -> dict:
    """The paired comparison of per-run values that line up (``a[i]`` and ``b[i]`` from
    the same round and seed): ``{"mean_diff", "ci95", "n", "separated"}``, the mean of
    a - b and its 95% interval over the n pairs (pairs with a None left out);
    separated when the interval excludes 0 (never with fewer than two pairs)."""
    if len(a) != len(b):
        raise ValueError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
    d = mean_ci(x - y for x, y in zip(a, b) if x is not None and y is not None)
    ci = d["ci95"]
    sep = ci is not None and (ci[0] > 0 or ci[1] < 0)
    return {"mean_diff": d["mean"], "ci95": ci, "n": d["n"], "separated": sep}


def compare(a: Sequence, b: Sequence) -> dict:
    """Both tests of ``a`` against ``b`` (aligned per-run values):
    ``{"intervals": {"separated"}, "paired": paired_difference(a, b)}``."""
    return {
        "intervals": {"separated": intervals_separated(a, b)["separated"]},
        "paired": paired_difference(a, b),
    }
