"""Overload (``adaserve``): the requests no tree can bring within their target, and
those infeasible long enough to be degraded to a looser class."""

from __future__ import annotations

import numpy as np

from adaserve.core.policy import Plan, ReqView
from adaserve.policies.budgeted.columns import Columns
from adaserve.policies.budgeted.config import AdaptiveConfig
from adaserve.policies.budgeted.evaluation import ShapeChoice


class InfeasibleStreaks:
    """rid -> how many plans in a row found the request infeasible."""

    __slots__ = ("streak",)

    def __init__(self) -> None:
        self.streak: dict[int, int] = {}

    def judge(
        self,
        dec: list[ReqView],
        arr: Columns,
        best: ShapeChoice,
        reach: float,
        plan: Plan,
        cfg: AdaptiveConfig,
    ) -> tuple[int, ...]:
        """The requests whose requirement no tree can meet (``reach``: the expected
        accepted candidates of the largest tree any request may get), after marking in
        ``plan.degrade`` those infeasible for ``degrade_after`` plans in a row (with
        ``degrade``)."""
        # beyond reach: not even the biggest tree any request may get would meet the
        # requirement at this plan's pace (a plan that merely chose a smaller tree,
        # or a prediction a little pessimistic, is no reason to degrade anyone)
        # judged at the real target (no margin) over the whole remaining output: the
        # pace A that brings the mean TPOT within target by the last token, A = L *
        # t_iter / (tpot * (n_out + L - 1) - l_r), L = the tokens it may still produce
        L = np.maximum(arr.left, 1.0)
        slack = arr.tpot * (arr.n_out + L - 1.0) - arr.decode_ms
        with np.errstate(divide="ignore", invalid="ignore"):
            pace = np.where(slack > 0, L * best.t_iter / slack, np.inf)
        infeasible = tuple(arr.rid[arr.has_tpot & (pace - 1.0 > reach + 1e-9)].tolist())
        bad = set(infeasible)
        for r in dec:
            s = self.streak.get(r.rid, 0) + 1 if r.rid in bad else 0
            self.streak[r.rid] = s
            if s >= cfg.degrade_after and cfg.degrade:
                plan.degrade[r.rid] = "looser"
                self.streak[r.rid] = 0
        if len(self.streak) > 4 * len(dec) + 64:
            live = {r.rid for r in dec}
            self.streak = {k: v for k, v in self.streak.items() if k in live}
        return infeasible
