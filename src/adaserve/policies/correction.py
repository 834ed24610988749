"""Online correction of the hardware model: measured minus profiled iteration time,
fitted as the policies run (no torch)."""

from __future__ import annotations

from typing import Any

import numpy as np


class OnlineCorrection:
    """Measured minus profiled iteration time, fitted online as a linear function of
    [1, profiled ms, verified tokens, draft steps, draft steps x speculating requests]
    by ridge regression with exponential forgetting.

    The profiled-ms feature is the machine's speed factor: a CPU that runs 1.4x slower
    than when it was profiled (shared cores, frequency drift) leaves a residual of
    0.4 x the profile, for every plan alike. It is penalised least, so a uniform
    slowdown is learned as a ratio and keeps the profile's relative prices of tokens
    and draft steps. The other slopes only pick up what scaling does not explain (a
    per-token or per-draft-step cost the profile misses). Without the speed feature a
    slowdown lands on whichever slope is least penalised; since a chain's verified
    tokens are n x (1 + depth), that was depth x requests, and every deeper tree was
    overpriced. The constant is penalised more than the speed factor and less than
    the slopes."""

    PENALTY = (50.0, 1.0, 20000.0, 500.0, 500.0)

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self.ridge = np.diag(np.array(self.PENALTY))
        self.A = self.ridge.copy()
        self.b = np.zeros(len(self.PENALTY))
        self.theta: np.ndarray = np.zeros(len(self.PENALTY))

    @staticmethod
    def features(static_ms: Any, tokens: Any, steps: Any, spec_requests: Any) -> np.ndarray:
        """Feature rows [..., 5] for broadcastable inputs."""
        st, t, d, n = np.broadcast_arrays(
            *(np.asarray(x, dtype=float) for x in (static_ms, tokens, steps, spec_requests))
        )
        return np.stack([np.ones_like(st), st, t, d, d * n], axis=-1)

    def residual(self, static_ms: Any, tokens: Any, steps: Any, spec_requests: Any) -> Any:
        """Predicted measured-minus-profiled ms (broadcast over the inputs): the value of
        ``predict(features(...))`` without building the feature rows. The planner's array
        program inlines this (``budgeted.evaluation.evaluate_depths``)."""
        th = self.theta
        return th[0] + th[1] * static_ms + th[2] * tokens + (th[3] + th[4] * spec_requests) * steps

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Predicted measured-minus-profiled ms of feature rows ``x``."""
        out: np.ndarray = x @ self.theta
        return out

    def update(self, x: np.ndarray, residual_ms: float) -> None:
        """Nothing; folds in one iteration's features and measured residual."""
        self.A = self.decay * self.A + np.outer(x, x) + (1 - self.decay) * self.ridge
        self.b = self.decay * self.b + x * residual_ms
        self.theta = np.linalg.solve(self.A, self.b)
