"""The planner's margin: how far below each TPOT target its plans aim."""

from __future__ import annotations

import math

from adaserve.policies.budgeted.config import AdaptiveConfig


class MarginEstimate:
    """The spread of measured / predicted pass time, and the margin it calls for.

    ``observe`` takes each measured pass's relative error (measured / predicted - 1):
    a running mean and mean square, then an EWMA over about 50 passes."""

    __slots__ = ("n", "mean", "sq")

    def __init__(self) -> None:
        self.n, self.mean, self.sq = 0, 0.0, 0.0

    def observe(self, e: float) -> None:
        """Take one pass's relative error."""
        k = self.n = self.n + 1
        a = max(1.0 / k, 0.02)  # a running mean, then an EWMA over ~50 passes
        self.mean += a * (e - self.mean)
        self.sq += a * (e * e - self.sq)

    def margin(self, cfg: AdaptiveConfig) -> float:
        """The fraction of each TPOT target the plans aim below: ``slo_margin``, or with
        ``margin_auto`` (after ``margin_warmup`` measured passes) ``margin_floor`` plus
        twice the spread of measured / predicted pass time, capped at ``margin_max``."""
        if not cfg.margin_auto or self.n < cfg.margin_warmup:
            return cfg.slo_margin
        sd = math.sqrt(max(self.sq - self.mean**2, 0.0))
        return min(cfg.margin_floor + 2.0 * sd, cfg.margin_max)
