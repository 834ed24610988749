"""What a class's admitted requests realised against what admission predicted for them
(``Calibration``): the chance of a prediction, for the promise every admitted request
carries (``core.admission``). Torch-free."""

from __future__ import annotations

import math
from collections import deque

# finishes before a class's own fit stands for it (else the prior applies)
_MIN_FINISHES = 4
# pseudo-finishes that hold a class's calibration to the model's own word (realised =
# predicted) until its own finishes outweigh them
_PRIOR_WEIGHT = 0.1
# the finishes a class's chances are counted over (1.5% steps)
WINDOW = 64
_CLASS_EWMA = 0.05  # weight of the newest finish in the fit


def _phi(z: float) -> float:
    """The standard normal distribution function."""
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


class Calibration:
    """What one class's admitted requests realised against what was predicted at their
    admission (TPOT or TTFT): a fit of ``y = log(realised / target)`` on ``u =
    log(predicted / target)``, ``y = a + b u + e``, by exponentially weighted least
    squares (about the last ``1 / _CLASS_EWMA`` finishes), shrunk toward the model's
    own word (``a = 0, b = 1``: a request realises what was predicted) by
    ``_PRIOR_WEIGHT`` pseudo-finishes. ``e`` is each finish's error, taken before the
    fit learns from it; the chance of a prediction is the share of the last
    ``WINDOW`` errors that keep it within target (their own law, which is skewed:
    the planner holds a request near its target from both sides), or a normal law of the
    prior spread until ``_MIN_FINISHES``. The planner steers every request toward its
    target, so what is realised depends less on the prediction than the model alone
    says while the load is feasible (``b`` below 1), and more past it: the fit learns
    both."""

    __slots__ = ("n", "s", "b", "errs")

    def __init__(self) -> None:
        self.n = 0
        self.s = [0.0, 0.0, 0.0]  # weighted sums of 1, u, u*u
        self.b = [0.0, 0.0]  # weighted sums of y, u*y
        self.errs: deque[float] = deque(maxlen=WINDOW)  # errors, out of sample

    def coef(self) -> tuple[float, float]:
        """(a, b) of the fit (the model's own word before any finish)."""
        lam = _PRIOR_WEIGHT
        s0, s1, s2 = self.s[0] + lam, self.s[1], self.s[2] + lam
        b0, b1 = self.b[0], self.b[1] + lam  # the prior: a = 0, b = 1
        det = s0 * s2 - s1 * s1
        if det <= 1e-12:
            return 0.0, 1.0
        return (s2 * b0 - s1 * b1) / det, (s0 * b1 - s1 * b0) / det

    def add(self, realised: float, predicted: float, target: float) -> None:
        if realised <= 0 or predicted <= 0 or target <= 0:
            return
        u, y = math.log(predicted / target), math.log(realised / target)
        a, b = self.coef()
        self.errs.append(y - a - b * u)
        self.n += 1
        keep = 1.0 - _CLASS_EWMA
        for i, v in enumerate((1.0, u, u * u)):
            self.s[i] = keep * self.s[i] + v
        self.b[0] = keep * self.b[0] + y
        self.b[1] = keep * self.b[1] + u * y

    @property
    def ready(self) -> bool:
        """Enough finishes to stand for the class (else the prior applies)."""
        return self.n >= _MIN_FINISHES

    def chance(self, target: float, predicted: float, prior_spread: float) -> float:
        """The chance that a request predicted at ``predicted`` realises at most
        ``target`` (both ms): the fit's normal law of ``y`` at ``u``."""
        if target <= 0:
            return 0.0
        if predicted <= 0:
            return 1.0
        a, b = self.coef()
        mean = a + b * math.log(predicted / target)
        if self.ready:
            return sum(1 for e in self.errs if mean + e <= 0) / len(self.errs)
        if prior_spread < 1e-9:
            return 1.0 if mean <= 0 else 0.0
        return _phi(-mean / prior_spread)
