"""``BudgetedPolicy``: the budgeted planner and selection shared by ``adaserve``,
``dyn-tree`` and ``smartspec`` (``policies.py``).

A plan picks the iteration's verification budget B from the hardware model: it
evaluates every draft depth at each width (``widths.py``, ``exploration.py``;
``evaluation.py``), takes the best-scoring shape (``_pick``), optionally composes the
pass's prefill around it (``pass_composition.py``) and aims below each TPOT target by
a margin (``margin.py``) through the requirements A(r) (``requirements.py``).
Selection runs the SLO and goodput phases over the real trees (``phases.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from adaserve.core.policy import (
    BatchView,
    LoadHints,
    PassForecast,
    Plan,
    PlannerState,
    Policy,
    ReqView,
    chunk_prefills,
    prefill_pairs,
)
from adaserve.core.tree import CandidateTree
from adaserve.policies import plan_kernel
from adaserve.policies.budgeted import exploration, pass_composition, phases, requirements
from adaserve.policies.budgeted.columns import Columns
from adaserve.policies.budgeted.config import DEPTHS, AdaptiveConfig
from adaserve.policies.budgeted.constraints import PowerLimits, power_fallback
from adaserve.policies.budgeted.evaluation import DepthEvaluation, ShapeChoice, evaluate_depths
from adaserve.policies.budgeted.margin import MarginEstimate
from adaserve.policies.budgeted.widths import AcceptanceByRank, load_width, reach, tree_widths
from adaserve.policies.correction import OnlineCorrection
from adaserve.policies.typical_tree import depth_curve, gain_curve

# (score, rate, depth index, width index) of a candidate shape
Candidate = tuple[float, float, int, int]


@dataclass(frozen=True, eq=False)
class BudgetedState(PlannerState):
    """What a budgeted policy's plan keeps for its ``select``, ``feedback`` and
    ``load_hints``: the decoding requests' columns, the shape choice, and the requests
    whose requirement no tree can meet (``adaserve``)."""

    arrays: Columns
    choice: ShapeChoice
    infeasible: tuple[int, ...] = ()


class BudgetedPolicy(Policy):
    """The budgeted planner and selection. Subclasses override the hooks:
    ``_prefill_key``, ``_widths``, ``_pick``, ``_overload``, ``_slo_phase``,
    ``_composes``, ``_explores`` (and ``admission_key``), and set ``slo_phase`` /
    ``one_chain`` for the compiled depth evaluation."""

    slo_phase: bool = False  # plan the SLO phase (requirements) before the goodput phase
    one_chain: bool = False  # one chain length for the whole batch

    def __init__(self, cfg: AdaptiveConfig | None = None):
        self.cfg = cfg or AdaptiveConfig()
        self._acc_est = AcceptanceByRank()
        self.correction = OnlineCorrection()  # measured - profiled iteration time
        self._plans = 0  # plans made with decoding requests (exploration's clock)
        self._margin = MarginEstimate()  # measured / predicted pass time - 1
        self._steep = pass_composition.Steepness(self.cfg.sit_out_steepness)
        self._power = PowerLimits(self.cfg, self.name)
        _warm_up()

    @property
    def acc_by_rank(self) -> tuple[float, ...]:
        """The calibrated acceptance of a child by sibling rank the plans use."""
        return self._acc_est.value

    @property
    def margin(self) -> float:
        """The fraction of each TPOT target the plans aim below (``MarginEstimate``)."""
        return self._margin.margin(self.cfg)

    # ------------------------------------------------------------------ hooks
    def _widths(self, n: int) -> tuple[int, ...]:
        """Beam widths to evaluate for ``n`` decoders (``widths.tree_widths``)."""
        return tree_widths(n, self.acc_by_rank, self.cfg)

    def _width(self, n: int) -> int:
        """Beam width from load: wide trees only when few requests share the pass."""
        return load_width(n, self.cfg)

    def _prefill_key(self) -> Callable[[ReqView], tuple[Any, ...]] | None:
        """The order prefilling requests share the chunk in (None: the view's)."""
        return None

    def _composes(self) -> bool:
        """Whether the plan composes the pass (``pass_composition.compose``). Default:
        no; prefill is chunked in ``_prefill_key`` order whatever the decoders need."""
        return False

    def _explores(self) -> bool:
        """Whether some plans draft width-2 trees to learn rank-2 acceptance
        (``exploration.py``). Default: no."""
        return False

    def _own_acceptance(self) -> bool:
        """Whether the plan scales the calibrated acceptance by the decoders' own
        drafts' confidence (``own_acceptance``) on steep hardware. Default: no (the
        published baselines plan with the calibrated mean)."""
        return False

    def _pick(self, evs: list[DepthEvaluation], D: int) -> Candidate:
        """The (score, rate, depth index, width index) of the shape to take, from the
        evaluations of each width over D depths: the highest rate (the first shape on
        ties), score 0."""
        cand = [(0.0, float(ev.rate[i]), i, j) for j, ev in enumerate(evs) for i in range(D)]
        return max(cand, key=lambda c: (c[1], -c[3], -c[2]))

    def _overload(
        self,
        dec: list[ReqView],
        arr: Columns,
        best: ShapeChoice,
        widths: tuple[int, ...],
        acc: tuple[float, ...],
        plan: Plan,
    ) -> tuple[int, ...]:
        """The requests whose requirement no tree can meet (a tuple of rids), after
        marking those to degrade in ``plan.degrade``. Default: none."""
        return ()

    def _slo_phase(
        self,
        view: BatchView,
        plan: Plan,
        rids: list[int],
        F: np.ndarray,
        caps: np.ndarray,
        left: int,
    ) -> np.ndarray:
        """Candidates per tree [R] the SLO phase takes before the goodput phase, of at
        most ``left`` in all (F: each tree's f sorted descending [R, M]; caps [R]).
        Default: none."""
        return np.zeros(len(rids), dtype=np.int64)

    # ------------------------------------------------------------------ requirements
    def requirement(self, r: ReqView, t_iter: float) -> float:
        """A(r): accepted tokens this iteration that keep r's mean TPOT within target."""
        return float(self._requirements(Columns.of([r]), t_iter)[0])

    def _coef(self, a: Columns) -> tuple[np.ndarray, np.ndarray]:
        """A(r)'s per-request constants (``requirements.coefficients``)."""
        return requirements.coefficients(a, self.cfg, self.margin)

    def _requirements(self, a: Columns, t_iter: float) -> np.ndarray:
        """A(r) for every request at once: [n]."""
        return requirements.requirements(a, t_iter, self.cfg, self.margin)

    def _reach(self, widths: tuple[int, ...], acc: tuple[float, ...]) -> float:
        """Expected accepted candidates of the largest tree any request may get."""
        return reach(widths, acc, self.cfg)

    def explain(self, req: ReqView, plan: Plan) -> dict[str, Any]:
        """The selection log's record of ``req``: ``{"requirement": A(r) at the plan's
        predicted iteration time, to 3 places (None when it predicts none)}``."""
        t = plan.t_iter_ms
        return {"requirement": round(self.requirement(req, t), 3) if t else None}

    # ------------------------------------------------------------------ feedback
    def feedback(self, plan: Plan, measured_ms: float) -> None:
        """Nothing; fits the gap between measured and profiled iteration times (see
        OnlineCorrection) from a plan of this policy's, and the margin's spread."""
        state = plan.state
        if isinstance(state, BudgetedState) and measured_ms > 0:
            x, static = state.choice.features, state.choice.t_static
            self.correction.update(np.asarray(x, dtype=float), measured_ms - static)
            if state.choice.t_iter > 0:
                self._margin.observe(measured_ms / state.choice.t_iter - 1.0)

    def load_hints(self, plan: Plan | None) -> LoadHints:
        """The router's reading of this policy and its latest ``plan``: the calibrated
        acceptance, the margin, the prefill chunk, and the tokens a pass verifies per
        planned decoder (1 + its allocated candidates)."""
        acc = self.acc_by_rank
        state = plan.state if plan is not None else None
        verified: dict[int, float] = {}
        expected: dict[int, float] = {}
        if isinstance(state, BudgetedState) and acc:
            ch = state.choice
            g = gain_curve(ch.depth, ch.width, acc)
            gain = g[np.minimum(ch.alloc, len(g) - 1)]
            for rid, k, x in zip(state.arrays.rid.tolist(), ch.alloc.tolist(), gain.tolist()):
                verified[int(rid)] = 1.0 + float(k)
                expected[int(rid)] = 1.0 + float(x)
        return LoadHints(
            acc_by_rank=tuple(acc),
            margin=float(self.margin),
            prefill_chunk=int(self.cfg.prefill_chunk),
            verified=verified,
            expected=expected,
        )

    # ------------------------------------------------------------------ forecast
    def forecast(
        self, view: BatchView, prefill: dict[int, tuple[float, float]]
    ) -> PassForecast | None:
        """The pass this planner would plan for ``view``'s decoders with ``prefill``
        (rank -> (prompt tokens per pass that meet its queued requests' TTFT
        deadlines, offered prompt tokens per pass)) to compose, at most one chunk:
        when it composes (``_composes``), the firm prefill (ranks below
        ``defer_rank``: the most of what its deadlines need and what is offered) and
        what the soft classes' queued deadlines need (a soft request is firm at its
        latest start); what is offered of the soft classes beyond that goes only into
        the slack the on-pace decoders leave (``pass_composition.compose``), so no
        decoder pays for it. Without composing, all of it. The
        best-scoring shape of the plan's own evaluation (``_best_shape``: the hardware
        model with the online correction; with the SLO phase, each request's
        requirement A(r), its deficit or credit so far, at the planner's margin) and
        each decoder's expected tokens from its allocation on the typical tree of that
        shape. Changes no state (no acceptance update, no exploration, no streaks).
        None without a hardware model or decoders."""
        dec = view.decoding
        hw = view.hw
        if hw is None or not dec:
            return None
        c = self.cfg
        acc = self.acc_by_rank
        arr = Columns.of(dec)
        kv = float(sum(r.context_len for r in view.requests))
        depths = tuple(d for d in DEPTHS if d <= c.max_depth)
        defer = self._defer_rank(hw)
        firm = sum(
            max(due, offered) if not self._composes() or r < defer else due
            for r, (due, offered) in prefill.items()
        )
        P = max(0, min(int(firm), c.prefill_chunk))
        best = self._best_shape(view, arr, depths, self._widths(len(dec)), P, kv, acc)
        g = gain_curve(best.depth, best.width, acc)
        gain = g[np.minimum(best.alloc, len(g) - 1)] if best.depth > 0 else np.zeros(len(dec))
        tokens = {int(rid): 1.0 + float(x) for rid, x in zip(arr.rid.tolist(), gain.tolist())}
        return PassForecast(t_iter_ms=best.t_iter, tokens=tokens)

    # ------------------------------------------------------------------ plan
    def plan(self, view: BatchView) -> Plan:
        """The iteration's plan: prefill chunks, per-request tree shapes under the
        budget B of the best-scoring shape, and its predicted iteration time."""
        c = self.cfg
        dec = view.decoding
        hw = view.hw
        if hw is None or not dec:
            prefill = chunk_prefills(view, c.prefill_chunk, self._prefill_key())
            return Plan(prefill=prefill, fallback="no_profile" if dec and hw is None else None)
        n = len(dec)
        kv = float(sum(r.context_len for r in view.requests))
        acc = self._acc_est.update(view.acc_by_rank, c.max_width)
        if self._own_acceptance() and self._steep(hw):
            acc = own_acceptance(acc, dec)
        arr = Columns.of(dec)
        depths = tuple(d for d in DEPTHS if d <= c.max_depth)
        widths = self._widths(n)
        self._plans += 1
        if self._explores():
            widths = exploration.explored_widths(widths, self._plans, c)

        def shape(prefill: dict[int, int]) -> ShapeChoice:
            pairs = prefill_pairs(view, prefill)
            return self._best_shape(
                view, arr, depths, widths, sum(prefill.values()), kv, acc, pairs
            )

        skip: set[int] = set()
        if self._composes():
            prefill, best = self._compose(view, arr, widths, acc, shape)
            skip = self._sit_out(dec, arr, best, widths, acc, hw)
            if skip:  # re-plan the pass without them (``shape`` sees the new arr, kv)
                dec = [r for r in dec if r.rid not in skip]
                kv -= sum(r.context_len for r in view.decoding if r.rid in skip)
                arr = Columns.of(dec)
                prefill, best = self._compose(view, arr, widths, acc, shape)
        else:
            prefill = chunk_prefills(view, c.prefill_chunk, self._prefill_key())
            best = shape(prefill)
        d, w = best.depth, best.width
        plan = Plan(prefill=prefill, budget=best.budget, t_iter_ms=best.t_iter, skip=skip)
        plan.energy_j, plan.fallback = best.energy_j, best.fallback
        if d > 0:
            # per-request shapes: a request drafts only as deep as its best k candidates
            # reach in the typical tree
            dc = depth_curve(d, w, acc)
            ks = best.alloc
            reach_d = np.maximum(1, dc[np.minimum(ks, len(dc) - 1)])
            for rid, k, dr in zip(arr.rid.tolist(), ks.tolist(), reach_d.tolist()):
                if k > 0:
                    plan.shapes[rid] = (dr, w)
                    plan.node_cap[rid] = c.node_cap
        infeasible = self._overload(dec, arr, best, widths, acc, plan)
        plan.state = BudgetedState(arrays=arr, choice=best, infeasible=infeasible)
        return plan

    def _compose(
        self,
        view: BatchView,
        arr: Columns,
        widths: tuple[int, ...],
        acc: tuple[float, ...],
        shape: pass_composition.ShapeFn,
    ) -> tuple[dict[int, int], ShapeChoice]:
        """The pass's prefill and tree shape, composed (``pass_composition.compose``)."""
        th = self.correction.theta
        return pass_composition.compose(
            view,
            arr,
            widths,
            acc,
            shape,
            cfg=self.cfg,
            theta=th,
            margin=self.margin,
            defer_rank=self._defer_rank(view.hw),
        )

    def _defer_rank(self, hw: Any) -> int:
        """The rank from which prefill is soft (``defer_rank``): every class's on
        hardware whose pass cost is steep (``sit_out_steepness``), where a strict
        prompt's chunk costs its own class's decoders more than its TTFT needs (on the
        CPU pair a 256-token chunk is about ten interactive tokens' budget); a strict
        request still prefills at once once it reaches its latest start."""
        return 0 if self._steep(hw) else self.cfg.defer_rank

    def _sit_out(
        self,
        dec: list[ReqView],
        arr: Columns,
        best: ShapeChoice,
        widths: tuple[int, ...],
        acc: tuple[float, ...],
        hw: Any,
    ) -> set[int]:
        """Relaxed decoders that sit this pass out (``pass_composition.sit_out``): on
        with ``sit_out``, or on hardware whose pass cost is steep
        (``sit_out_steepness``)."""
        if not (self.cfg.sit_out or self._steep(hw)):
            return set()
        return pass_composition.sit_out(
            dec, arr, best, widths, acc, cfg=self.cfg, margin=self.margin
        )

    def _best_shape(
        self,
        view: BatchView,
        arr: Columns,
        ds: tuple[int, ...],
        widths: tuple[int, ...],
        P: int,
        kv: float,
        acc: tuple[float, ...],
        pairs: float = 0.0,
    ) -> ShapeChoice:
        """The tree shape (depth in ``ds``, width in ``widths``) whose predicted outcome
        scores best (``_pick``), with that outcome; ``need`` only when ``slo_phase``.
        ``pairs``: the prefill chunks' new x cached token pairs (``prefill_pairs``)."""
        evs = [
            self._evaluate_depths(view, arr, ds, w, P, kv, acc, pairs).power_masked()
            for w in widths
        ]
        m, r, i, j = self._pick(evs, len(ds))
        ev = evs[j]
        energy = float(ev.energy_j[i]) if ev.energy_j is not None else None
        t_iter = float(ev.t_iter[i])
        return ShapeChoice(
            energy_j=energy,
            fallback=power_fallback(self.cfg, energy, t_iter, len(arr.rid), ds[i]),
            depth=ds[i],
            width=widths[j],
            budget=int(ev.budget[i]),
            alloc=ev.alloc[i],
            t_iter=t_iter,
            rate=r,
            score=m,
            t_static=float(ev.static[i]),
            need=ev.need[i] if ev.need is not None else None,
        )

    def _evaluate_depths(
        self,
        view: BatchView,
        arr: Columns,
        ds: tuple[int, ...],
        w: int,
        P: int,
        kv: float,
        acc: tuple[float, ...],
        pairs: float = 0.0,
    ) -> DepthEvaluation:
        """Predicted outcome of drafting each depth of ``ds`` at width w for this batch
        (``evaluation.evaluate_depths``)."""
        return evaluate_depths(
            view, arr, ds, w, P, kv, acc, pairs,
            cfg=self.cfg,
            theta=self.correction.theta,
            coef=self._coef(arr) if self.slo_phase else None,
            one_chain=self.one_chain,
            power=self._power.of(view),
        )  # fmt: skip

    # ------------------------------------------------------------------ select
    def select(
        self, view: BatchView, plan: Plan, trees: dict[int, CandidateTree]
    ) -> dict[int, np.ndarray]:
        """rid -> the nodes of its tree to verify (sorted, containing 0): the SLO phase
        (``_slo_phase``), then the goodput phase (``phases.select_nodes``)."""
        return phases.select_nodes(view, plan, trees, self.cfg.node_cap, self._slo_phase)


@lru_cache(maxsize=1)
def _warm_up() -> None:
    """Compile the planner's kernel once per process, when the first policy is built."""
    plan_kernel.warm_up()


def own_acceptance(acc: tuple[float, ...], dec: list[ReqView]) -> tuple[float, ...]:
    """The calibrated acceptance by sibling rank ``acc`` scaled by the decoders' mean
    ``ReqView.acc_scale`` where that is below 1: the plan's shapes and rates then price
    what these requests' drafts are worth, not the mean request's. Never scaled up: a
    confident batch's deeper trees cost more draft passes than they gain."""
    rho = sum(r.acc_scale for r in dec) / len(dec) if dec else 1.0
    return acc if rho >= 1.0 else tuple(a * rho for a in acc)
