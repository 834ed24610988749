"""A(r): the accepted tokens a request needs from this pass to keep its TPOT aim.

A(r) is the pace that brings r's mean TPOT back to its aim (its target less the
planner's margin, ``margin.MarginEstimate``) within the next H output tokens (H =
``catch_up_tokens``, or the tokens it has left if fewer): ``H / A`` iterations of
``t_iter`` must fit in ``aim * (n_out + H - 1) - l_r``. A request a little behind
needs a somewhat bigger tree for a few iterations, not its whole deficit in one; one
that cannot catch up even so needs the most (and is infeasible). H = 0 is the paper's
one-iteration form (l_r + t_iter) / aim - n_out + 1.
"""

from __future__ import annotations

import numpy as np

from adaserve.policies.budgeted.columns import Columns
from adaserve.policies.budgeted.config import AdaptiveConfig


def coefficients(a: Columns, cfg: AdaptiveConfig, margin: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-request constants, computed once per batch (cached on ``a``): A(r) =
    clip(t_iter * slope + base, 1, max_depth + 1); 0 and 1 for requests without a TPOT
    target. [n] each."""
    if a.coef is None:
        aim = a.tpot * (1.0 - margin)  # NaN without a target
        has = a.has_tpot
        if cfg.catch_up_tokens == 0:
            slope, base = 1.0 / aim, a.decode_ms / aim - a.n_out + 1.0
        else:
            h = np.minimum(np.maximum(a.left, 1.0), cfg.catch_up_tokens)
            slack = aim * (a.n_out + h - 1.0) - a.decode_ms
            slope = np.divide(h, slack, out=np.full(len(h), np.inf), where=slack > 0)
            base = 0.0
        a.coef = (np.where(has, slope, 0.0), np.where(has, base, 1.0))
    return a.coef


def requirements_at(
    a: Columns, t_iter: np.ndarray, cfg: AdaptiveConfig, margin: float
) -> np.ndarray:
    """A(r) for m iteration times at once: [m] -> [m, n]."""
    slope, base = coefficients(a, cfg, margin)
    need = np.asarray(t_iter, dtype=float)[:, None] * slope + base
    out: np.ndarray = np.minimum(np.maximum(need, 1.0), cfg.max_depth + 1)
    return out


def requirements(a: Columns, t_iter: float, cfg: AdaptiveConfig, margin: float) -> np.ndarray:
    """A(r) for every request at once: [n]."""
    row: np.ndarray = requirements_at(a, np.array([t_iter], dtype=float), cfg, margin)[0]
    return row
