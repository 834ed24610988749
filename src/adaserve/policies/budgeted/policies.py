"""The budgeted policies: ``adaserve`` (SLO-customized), ``dyn-tree`` and ``smartspec``.

All three pick the iteration's verification budget B from the hardware model
(``planner.BudgetedPolicy``) and override its hooks.

* ``adaserve``: SLO phase (most-behind first, each request takes its highest-f
  candidates until its expected accepted tokens reach its requirement A(r), capped),
  then goodput phase (globally highest-f candidates). The tree shape: of those that
  meet the most requirements, the one with the highest predicted decode rate (a
  prefill chunk's time left out; rates within ``rate_tolerance`` tie, the cheapest
  shape winning). Prefill is chunked, shares B, and
  waiting requests are ordered by TTFT deadline. Overload: requests whose requirement
  stays infeasible are degraded to a looser class; relaxed requests past their
  maximum queue wait are admitted first.
* ``dyn-tree``: the goodput phase only (global best-f selection under B; EAGLE-2 /
  Sequoia style), SLO-oblivious.
* ``smartspec``: one chain length for the whole batch, chosen to maximise predicted
  goodput, SLO-oblivious.

Quantities (ms): A(r), the accepted tokens r needs this iteration, is the pace that
brings its mean TPOT back to its aim (target less ``slo_margin``) within the next H
output tokens: A(r) = H * t_iter / (aim_r * (o_r + H - 1) - l_r), clipped to
[1, d + 1] (H = ``catch_up_tokens``; H = 0 gives the paper's one-iteration form
(l_r + t_iter) / aim_r - o_r + 1; ``requirements.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from adaserve.core.policy import BatchView, Plan, ReqView
from adaserve.policies.budgeted.columns import Columns
from adaserve.policies.budgeted.config import AdaptiveConfig
from adaserve.policies.budgeted.evaluation import DepthEvaluation, ShapeChoice
from adaserve.policies.budgeted.overload import InfeasibleStreaks
from adaserve.policies.budgeted.phases import slo_phase_counts
from adaserve.policies.budgeted.planner import BudgetedPolicy, BudgetedState, Candidate


class AdaServePolicy(BudgetedPolicy):
    """``adaserve``: the SLO phase, then the goodput phase; the shape that meets the
    most requirements; TTFT-deadline admission and prefill order; overloaded requests
    degraded to a looser class."""

    name = "adaserve"
    slo_phase = True

    def __init__(self, cfg: AdaptiveConfig | None = None):
        super().__init__(cfg)
        self._streaks = InfeasibleStreaks()

    def _prefill_key(self) -> Callable[[ReqView], tuple[Any, ...]]:
        """Earliest TTFT deadline first."""
        return _ttft_deadline

    def _composes(self) -> bool:
        """Compose the pass unless ``compose`` is off."""
        return self.cfg.compose

    def _explores(self) -> bool:
        """Explore wider trees unless ``explore_every`` is 0."""
        return self.cfg.explore_every > 0

    def _own_acceptance(self) -> bool:
        """Plan at the decoders' own drafts' acceptance unless ``request_acceptance``
        is off."""
        return self.cfg.request_acceptance

    def admission_key(self, waiting: ReqView) -> tuple[Any, ...]:
        """The admission sort key: past its max queue wait first, then the earliest
        TTFT deadline."""
        overdue = (
            0
            if waiting.max_queue_ms is not None and waiting.waited_ms >= waiting.max_queue_ms
            else 1
        )
        deadline = (waiting.ttft_ms or 1e9) - waiting.waited_ms
        return (overdue, deadline)

    def _pick(self, evs: list[DepthEvaluation], D: int) -> Candidate:
        """The (score, rate, depth index, width index) of the shape to take: of the
        shapes that meet the most requirements (weighted), and of those whose predicted
        rate is within ``rate_tolerance`` of the best of them, the cheapest: the
        shallowest, then the narrowest."""
        cand: list[Candidate] = []  # (met_w, rate, depth index, width index)
        for j, ev in enumerate(evs):
            met_w = ev.met_w
            assert met_w is not None  # slo_phase: the evaluation weighs the requirements
            cand.extend((float(met_w[i]), float(ev.rate[i]), i, j) for i in range(D))
        top = max(c[0] for c in cand)
        floor = (1.0 - self.cfg.rate_tolerance) * max(c[1] for c in cand if c[0] == top)
        return min((c for c in cand if c[0] == top and c[1] >= floor), key=_cheapest)

    def _overload(
        self,
        dec: list[ReqView],
        arr: Columns,
        best: ShapeChoice,
        widths: tuple[int, ...],
        acc: tuple[float, ...],
        plan: Plan,
    ) -> tuple[int, ...]:
        """The requests whose requirement no tree can meet, after marking in
        ``plan.degrade`` those infeasible for ``degrade_after`` plans in a row
        (``overload.py``)."""
        return self._streaks.judge(dec, arr, best, self._reach(widths, acc), plan, self.cfg)

    def _slo_phase(
        self,
        view: BatchView,
        plan: Plan,
        rids: list[int],
        F: np.ndarray,
        caps: np.ndarray,
        left: int,
    ) -> np.ndarray:
        """Candidates per tree [R]: each request's fewest best-f nodes whose expected
        gain reaches its requirement A(r) - 1 (capped), the most behind first, until
        ``left`` runs out."""
        state = plan.state
        arr = state.arrays if isinstance(state, BudgetedState) else None
        if arr is None or arr.rid.tolist() != rids:
            by_id = {r.rid: r for r in view.requests}
            arr = Columns.of([by_id[r] for r in rids])
        t_iter = plan.t_iter_ms if plan.t_iter_ms is not None else 0.0
        need = self._requirements(arr, t_iter) - 1.0
        return slo_phase_counts(need, F, caps, left)


class DynTreePolicy(BudgetedPolicy):
    """``dyn-tree``: the goodput phase only (global best-f selection under B)."""

    name = "dyn-tree"


class SmartSpecPolicy(BudgetedPolicy):
    """``smartspec``: one chain length for the whole batch."""

    name = "smartspec"
    one_chain = True

    def _widths(self, n: int) -> tuple[int, ...]:
        """A chain only."""
        return (1,)


def _ttft_deadline(r: ReqView) -> tuple[Any, ...]:
    """The prefill sort key: time left to r's TTFT deadline, then its id."""
    return ((r.ttft_ms or 1e9) - r.waited_ms, r.rid)


def _cheapest(c: Candidate) -> tuple[Any, ...]:
    """Order of (met_w, rate, depth index, width index) candidates by tree cost."""
    return (c[2], c[3], -c[1])


ADAPTIVE_POLICIES: dict[str, type[BudgetedPolicy]] = {
    p.name: p for p in (AdaServePolicy, DynTreePolicy, SmartSpecPolicy)
}


def make_adaptive(name: str, **kwargs: Any) -> BudgetedPolicy:
    """The budgeted policy called ``name``, with ``AdaptiveConfig`` overrides ``kwargs``."""
    if name not in ADAPTIVE_POLICIES:
        raise ValueError(name)
    return ADAPTIVE_POLICIES[name](AdaptiveConfig(**kwargs) if kwargs else None)
