"""Which beam widths a plan evaluates, from the load and the calibrated acceptance."""

from __future__ import annotations

import numpy as np

from adaserve.policies.budgeted.config import AdaptiveConfig
from adaserve.policies.typical_tree import gain_curve


class AcceptanceByRank:
    """The calibrated acceptance of a child by its sibling rank, as the planner uses
    it: the view's (``BatchView.acc_by_rank``), rounded to 2 places and cut to
    ``max_width``; a prior until a view carries one."""

    __slots__ = ("value", "_seen")

    def __init__(self, prior: tuple[float, ...] = (0.6, 0.15, 0.07, 0.04)) -> None:
        self.value = prior
        self._seen: tuple[float, ...] = ()

    def update(self, acc: tuple[float, ...], max_width: int) -> tuple[float, ...]:
        """Take the view's acceptance ``acc`` (empty: keep the last one); the value."""
        if acc and acc != self._seen:
            self._seen = acc
            self.value = tuple(round(float(x), 2) for x in acc[:max_width])
        return self.value


def load_width(n: int, cfg: AdaptiveConfig) -> int:
    """Beam width from load: wide trees only when few requests share the pass."""
    return int(np.clip(8 // max(n, 1), 1, cfg.max_width))


def tree_widths(n: int, acc: tuple[float, ...], cfg: AdaptiveConfig) -> tuple[int, ...]:
    """Beam widths to evaluate for ``n`` decoders: a chain always; wider trees only at
    low load, and only while second-ranked children are accepted often enough to pay
    for a node (each sibling costs a draft token, a verified token and host work per
    step, which the profile prices lower than the engine pays on a CPU)."""
    if len(acc) < 2 or acc[1] < cfg.min_sibling_acceptance:
        return (1,)
    wide = load_width(n, cfg)
    return (1,) if wide == 1 else (1, wide)


def reach(widths: tuple[int, ...], acc: tuple[float, ...], cfg: AdaptiveConfig) -> float:
    """Expected accepted candidates of the largest tree any request may get."""
    g = gain_curve(cfg.max_depth, max(widths), acc)
    return float(g[min(cfg.node_cap, len(g) - 1)])
