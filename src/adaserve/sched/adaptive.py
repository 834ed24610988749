"""Budgeted tree policies: ``adaserve`` (SLO-customized), ``dyn-tree`` and ``smartspec``.

All three pick the iteration's verification budget B from the hardware model:
``BudgetedPolicy`` holds the shared planner and selection, and ``AdaServePolicy``,
``DynTreePolicy`` and ``SmartSpecPolicy`` override its hooks.

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
(l_r + t_iter) / aim_r - o_r + 1).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from adaserve.core.tree import CandidateTree
from adaserve.sched import composition, plan_kernel
from adaserve.sched.base import (
    BatchView,
    Plan,
    PlannerState,
    Policy,
    ReqView,
    chunk_prefills,
    prefill_pairs,
)
from adaserve.sched.correction import OnlineCorrection
from adaserve.sched.typical_tree import curve_rows, depth_curve, gain_curve

DEPTHS = (0, 1, 2, 3, 4, 5, 6, 8)


@dataclass(frozen=True)
class AdaptiveConfig:
    """Knobs of the budgeted policies (validated)."""

    max_depth: int = 8
    max_width: int = 4
    node_cap: int = 48  # max candidates selected for one request
    prefill_chunk: int = 256
    # ``adaserve``: move a request no tree can bring within its target (judged over its
    # remaining output) to its class's looser class after degrade_after such plans in a
    # row. Off: on the reference experiment it changed attainment by -1.1 to +0.3
    # points at 2-4 req/s (docs/results/pass-composition.md)
    degrade: bool = False
    degrade_after: int = 16  # consecutive infeasible iterations before degrading
    max_budget: int = 1024  # verification tokens per pass, hard ceiling
    # plan to beat each TPOT target by this fraction: iteration times on a shared CPU
    # (and acceptance) vary, and a plan aimed exactly at the target misses half the time
    slo_margin: float = 0.15
    # margin_auto: once margin_warmup passes are measured, the margin is margin_floor
    # plus twice the spread (std) of measured / predicted pass time, at most
    # margin_max: as small as the prediction is good (docs/results/pass-composition.md)
    margin_auto: bool = True
    margin_floor: float = 0.0
    margin_max: float = 0.3
    margin_warmup: int = 32
    # consider trees wider than a chain only when the calibrated acceptance of a
    # second-ranked child reaches this (0 = always consider them)
    min_sibling_acceptance: float = 0.2
    # A(r) makes up a TPOT deficit within this many output tokens (or by the end of the
    # output, if sooner); 0 = within this iteration, the paper's form
    catch_up_tokens: int = 16
    # among the shapes that meet the most requirements, take the cheapest (shallowest,
    # then narrowest) whose predicted rate is within this fraction of the best one's
    # (0 = the highest predicted rate; 0.03 was 2 points worse on the A100 preset at
    # 10 req/s and within noise on the CPU profile: docs/results/shape-choice.md)
    rate_tolerance: float = 0.0
    # ``adaserve``: compose the pass (sched/composition.py): prefill of classes of rank
    # >= defer_rank runs only into the on-pace decoders' slack until its latest start
    # (a request without a TTFT target is treated as one of no_ttft_defer_ms)
    compose: bool = True
    defer_rank: int = 1
    no_ttft_defer_ms: float = 30000.0
    # ``adaserve``: every explore_every-th plan that would consider chains only drafts
    # width-2 trees instead, so the calibrator keeps learning how often second-ranked
    # children are accepted (chains alone teach it nothing about them); 0 = never
    explore_every: int = 256
    # ``adaserve``: relaxed decoders well inside their target sit a pass out while a
    # strict decoder is short of its requirement (``_sit_out``). Off: on the reference
    # experiment it cost 0.9 / 1.3 points at 2 / 3 req/s (the relaxed requests stay
    # longer; docs/results/pass-composition.md)
    sit_out: bool = False
    # ... and automatically where a pass's cost grows steeply with its tokens: when the
    # profile's 64-token verification costs at least this many one-token ones (the CPU
    # pair: 3.3x; the A100 70B preset: 1.5x); there a relaxed decoder's token is dear
    # to the strict ones. 0 = never automatically (docs/results/engine-issue30.md)
    sit_out_steepness: float = 2.5
    min_slack_tokens: int = 0  # soft prefill smaller than this waits (0: any slack is used)
    # power as a constraint (sched/power.py; needs the view's PowerModel): shapes whose
    # predicted power (W, the deployment's) exceeds power_cap_w, or whose predicted
    # energy per expected accepted token (J) exceeds energy_per_token_j, are not
    # options; depth 0 always is (a plan whose depth 0 exceeds them notes
    # fallback="power_cap" / "energy_budget"). 0 = off
    power_cap_w: float = 0.0
    energy_per_token_j: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_depth <= 16 or not 1 <= self.max_width <= 8:
            raise ValueError("max_depth must be in [1, 16] and max_width in [1, 8]")
        if not 0.0 <= self.min_sibling_acceptance <= 1.0:
            raise ValueError("min_sibling_acceptance must be in [0, 1]")
        if self.catch_up_tokens < 0:
            raise ValueError("catch_up_tokens must be >= 0")
        if not 0.0 <= self.slo_margin < 0.9:
            raise ValueError("slo_margin must be in [0, 0.9)")
        if not 0.0 <= self.margin_floor <= self.margin_max < 0.9 or self.margin_warmup < 1:
            raise ValueError("need 0 <= margin_floor <= margin_max < 0.9 and margin_warmup >= 1")
        if not 0.0 <= self.rate_tolerance < 1.0:
            raise ValueError("rate_tolerance must be in [0, 1)")
        if not (math.isfinite(self.sit_out_steepness) and self.sit_out_steepness >= 0):
            raise ValueError("sit_out_steepness must be >= 0 (0 = never automatically)")
        if self.node_cap < 1 or self.prefill_chunk < 1 or self.max_budget < 1:
            raise ValueError("node_cap, prefill_chunk and max_budget must be positive")
        if self.explore_every < 0:
            raise ValueError("explore_every must be >= 0")
        if self.degrade_after < 1:
            raise ValueError("degrade_after must be >= 1")
        if self.defer_rank < 0 or not self.no_ttft_defer_ms > 0 or self.min_slack_tokens < 0:
            raise ValueError(
                "defer_rank and min_slack_tokens must be >= 0 and no_ttft_defer_ms positive"
            )
        for v in (self.power_cap_w, self.energy_per_token_j):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError("power_cap_w and energy_per_token_j must be >= 0 (0 = off)")


@dataclass
class _Arrays:
    """Per-request quantities as arrays (vectorised planning)."""

    rid: np.ndarray
    decode_ms: np.ndarray
    n_out: np.ndarray
    tpot: np.ndarray
    has_tpot: np.ndarray
    weight: np.ndarray
    left: np.ndarray  # output tokens still allowed (max_tokens left)
    coef: tuple | None = None  # BudgetedPolicy._coef's constants, once computed
    constrained_share: float = 0.0  # of the requests, the share under a grammar

    @classmethod
    def of(cls, reqs: list[ReqView]) -> _Arrays:
        """The columns of ``reqs``."""
        # one conversion of a row per request (the planner's hot path), then columns;
        # strict classes weigh more: 3, 2, 1
        cols = np.array(
            [
                (r.rid, r.decode_ms, r.n_out, r.tpot_ms or np.nan, 3 - min(r.rank, 2))
                + (min(r.max_tokens, 1 << 20),)
                for r in reqs
            ],
            dtype=float,
        ).T.copy()
        rid, decode_ms, n_out, tpot, weight, left = cols
        return cls(
            rid=rid.astype(np.int64),
            decode_ms=decode_ms,
            n_out=n_out,
            tpot=tpot,
            has_tpot=~np.isnan(tpot),
            weight=weight,
            left=left,
            constrained_share=sum(r.constrained for r in reqs) / len(reqs) if reqs else 0.0,
        )


@dataclass(frozen=True, eq=False)
class ShapeChoice:
    """The tree shape a plan takes and its predicted outcome.

    alloc:    candidates per decoding request [n]
    t_iter:   predicted iteration ms; ``t_static`` its profile part
    rate:     predicted decode tokens per ms beyond the prefill chunk's time
    score:    weighted count of requirements met (``adaserve``; 0 otherwise)
    need:     the requirements A(r) at t_iter [n] (``adaserve``; None otherwise)
    energy_j: predicted energy of the pass (J; None without a power model)
    fallback: "power_cap" / "energy_budget" when even depth 0 breaks that constraint
    """

    depth: int
    width: int
    budget: int
    alloc: np.ndarray
    t_iter: float
    rate: float
    score: float
    t_static: float
    need: np.ndarray | None = None
    energy_j: float | None = None
    fallback: str | None = None

    @property
    def features(self) -> list[float]:
        """The plan's feature row for ``OnlineCorrection`` (its measured time fits it)."""
        d, n = self.depth, len(self.alloc)
        return [1.0, self.t_static, float(self.budget), float(d), float(d * n)]


@dataclass(frozen=True, eq=False)
class BudgetedState(PlannerState):
    """What a budgeted policy's plan keeps for its ``select`` and ``feedback``: the
    decoding requests' columns, the shape choice, and the requests whose requirement
    no tree can meet (``adaserve``)."""

    arrays: _Arrays
    choice: ShapeChoice
    infeasible: tuple[int, ...] = ()


class BudgetedPolicy(Policy):
    """The budgeted planner and selection shared by ``adaserve``, ``dyn-tree`` and
    ``smartspec``. Subclasses override the hooks: ``_prefill_key``, ``_widths``,
    ``_pick``, ``_overload``, ``_slo_phase`` (and ``admission_key``), and set
    ``slo_phase`` / ``one_chain`` for the compiled depth evaluation."""

    slo_phase: bool = False  # plan the SLO phase (requirements) before the goodput phase
    one_chain: bool = False  # one chain length for the whole batch

    def __init__(self, cfg: AdaptiveConfig | None = None):
        self.cfg = cfg or AdaptiveConfig()
        self.acc_by_rank: tuple[float, ...] = (0.6, 0.15, 0.07, 0.04)
        self._acc_seen: tuple = ()
        self.correction = OnlineCorrection()  # measured - profiled iteration time
        self._plans = 0  # plans made with decoding requests (exploration's clock)
        # measured / predicted pass time - 1: count, running mean and mean square
        self._err_n, self._err_mean, self._err_sq = 0, 0.0, 0.0
        self._steep_hw, self._steep_is = None, False  # ``_steep``'s hardware and verdict
        _warm_up()

    # ------------------------------------------------------------------ helpers
    def _acc(self, view: BatchView) -> tuple[float, ...]:
        acc = getattr(view, "acc_by_rank", None)
        if acc and acc != self._acc_seen:
            self._acc_seen = acc
            self.acc_by_rank = tuple(round(float(x), 2) for x in acc[: self.cfg.max_width])
        return self.acc_by_rank

    def _widths(self, n: int) -> tuple[int, ...]:
        """Beam widths to evaluate: a chain always; wider trees only at low load, and
        only while second-ranked children are accepted often enough to pay for a node
        (each sibling costs a draft token, a verified token and host work per step,
        which the profile prices lower than the engine pays on a CPU)."""
        acc = self.acc_by_rank
        if len(acc) < 2 or acc[1] < self.cfg.min_sibling_acceptance:
            return (1,)
        wide = self._width(n)
        return (1,) if wide == 1 else (1, wide)

    def _width(self, n: int) -> int:
        """Beam width from load: wide trees only when few requests share the pass."""
        return int(np.clip(8 // max(n, 1), 1, self.cfg.max_width))

    def _prefill_key(self) -> Callable[[ReqView], tuple] | None:
        """The order prefilling requests share the chunk in (None: the view's)."""
        return None

    def requirement(self, r: ReqView, t_iter: float) -> float:
        """A(r): accepted tokens this iteration that keep r's mean TPOT within target."""
        return float(self._requirements(_Arrays.of([r]), t_iter)[0])

    def explain(self, req: ReqView, plan: Plan) -> dict:
        """The selection log's record of ``req``: ``{"requirement": A(r) at the plan's
        predicted iteration time, to 3 places (None when it predicts none)}``."""
        t = plan.t_iter_ms
        return {"requirement": round(self.requirement(req, t), 3) if t else None}

    def _coef(self, a: _Arrays) -> tuple[np.ndarray, np.ndarray]:
        """Per-request constants, computed once per batch: A(r) = clip(t_iter * slope
        + base, 1, max_depth + 1) (aim: the TPOT r is planned for, its target less the
        margin); 0 and 1 for requests without a TPOT target. [n] each.

        A(r) is the pace that brings r's mean TPOT back to its aim within the next H
        output tokens (H = ``catch_up_tokens``, or the tokens it has left if fewer):
        ``H / A`` iterations of ``t_iter`` must fit in ``aim * (n_out + H - 1) - l_r``.
        A request a little behind needs a somewhat bigger tree for a few iterations,
        not its whole deficit in one; one that cannot catch up even so needs the most
        (and is infeasible). H = 0 is the paper's one-iteration form
        (l_r + t_iter) / aim - n_out + 1."""
        if a.coef is None:
            aim = a.tpot * (1.0 - self.margin)  # NaN without a target
            has = a.has_tpot
            if self.cfg.catch_up_tokens == 0:
                slope, base = 1.0 / aim, a.decode_ms / aim - a.n_out + 1.0
            else:
                h = np.minimum(np.maximum(a.left, 1.0), self.cfg.catch_up_tokens)
                slack = aim * (a.n_out + h - 1.0) - a.decode_ms
                slope = np.divide(h, slack, out=np.full(len(h), np.inf), where=slack > 0)
                base = 0.0
            a.coef = (np.where(has, slope, 0.0), np.where(has, base, 1.0))
        return a.coef

    def _requirements(self, a: _Arrays, t_iter: float) -> np.ndarray:
        """A(r) for every request at once: [n]."""
        return self._requirements_at(a, np.array([t_iter], dtype=float))[0]

    def _requirements_at(self, a: _Arrays, t_iter: np.ndarray) -> np.ndarray:
        """A(r) (see ``_coef``) for m iteration times at once: [m] -> [m, n]."""
        slope, base = self._coef(a)
        need = np.asarray(t_iter, dtype=float)[:, None] * slope + base
        return np.minimum(np.maximum(need, 1.0), self.cfg.max_depth + 1)

    def feedback(self, plan: Plan, measured_ms: float) -> None:
        """Nothing; fits the gap between measured and profiled iteration times (see
        OnlineCorrection) from a plan of this policy's."""
        state = plan.state
        if isinstance(state, BudgetedState) and measured_ms > 0:
            x, static = state.choice.features, state.choice.t_static
            self.correction.update(np.asarray(x, dtype=float), measured_ms - static)
            if state.choice.t_iter > 0:
                e = measured_ms / state.choice.t_iter - 1.0
                k = self._err_n = self._err_n + 1
                a = max(1.0 / k, 0.02)  # a running mean, then an EWMA over ~50 passes
                self._err_mean += a * (e - self._err_mean)
                self._err_sq += a * (e * e - self._err_sq)

    @property
    def margin(self) -> float:
        """The fraction of each TPOT target the plans aim below: ``slo_margin``, or with
        ``margin_auto`` (after ``margin_warmup`` measured passes) ``margin_floor`` plus
        twice the spread of measured / predicted pass time, capped at ``margin_max``."""
        c = self.cfg
        if not c.margin_auto or self._err_n < c.margin_warmup:
            return c.slo_margin
        sd = math.sqrt(max(self._err_sq - self._err_mean**2, 0.0))
        return min(c.margin_floor + 2.0 * sd, c.margin_max)

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
        acc = self._acc(view)
        arr = _Arrays.of(dec)
        depths = tuple(d for d in DEPTHS if d <= c.max_depth)
        widths = self._widths(n)
        self._plans += 1
        if widths == (1,) and self._explores() and self._plans % c.explore_every == 0:
            widths = (min(2, c.max_width),)  # an exploration plan (see explore_every)

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
                arr = _Arrays.of(dec)
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

    def _overload(
        self, dec: list[ReqView], arr: _Arrays, best: ShapeChoice, widths, acc, plan: Plan
    ) -> tuple[int, ...]:
        """The requests whose requirement no tree can meet (a tuple of rids), after
        marking those to degrade in ``plan.degrade``. Default: none."""
        return ()

    def _composes(self) -> bool:
        """Whether the plan composes the pass (``_compose``). Default: no; prefill is
        chunked in ``_prefill_key`` order whatever the decoders need."""
        return False

    def _explores(self) -> bool:
        """Whether some plans draft width-2 trees to learn rank-2 acceptance
        (``explore_every``). Default: no."""
        return False

    def _sit_out(self, dec, arr: _Arrays, best: ShapeChoice, widths, acc, hw) -> set[int]:
        """Relaxed decoders (rank >= ``defer_rank``) that sit this pass out so that strict
        ones behind their requirement get a shorter pass: only while some strict decoder
        the plan leaves short can still be helped, and only a relaxed decoder that stays
        within its aim even after this pass and the next give it one token
        (``decode_ms + 2 * t_iter <= aim * n_out``). On with ``sit_out``, or on hardware
        whose pass cost is steep (``sit_out_steepness``)."""
        c = self.cfg
        if not (c.sit_out or self._steep(hw)):
            return set()
        g = gain_curve(best.depth, best.width, acc)
        gain = g[np.minimum(best.alloc, len(g) - 1)]
        need = self._requirements(arr, best.t_iter)
        ranks = np.array([r.rank for r in dec])
        short = arr.has_tpot & (ranks < c.defer_rank) & (need > 1.0 + gain + 1e-9)
        if not (short & (need - 1.0 <= self._reach(widths, acc) + 1e-9)).any():
            return set()
        aim = arr.tpot * (1.0 - self.margin)
        fine = arr.decode_ms + 2.0 * best.t_iter <= aim * arr.n_out
        out = arr.has_tpot & (ranks >= c.defer_rank) & fine
        return set(arr.rid[out].tolist())

    def _steep(self, hw) -> bool:
        """Whether ``hw``'s verification cost grows steeply with the pass's tokens
        (``sit_out_steepness``; judged once per hardware model)."""
        k = self.cfg.sit_out_steepness
        if k <= 0 or hw is None:
            return False
        if self._steep_hw is not hw:
            self._steep_hw = hw
            self._steep_is = float(hw.verify_latency(64)) >= k * float(hw.verify_latency(1))
        return self._steep_is

    def _reach(self, widths, acc) -> float:
        """Expected accepted candidates of the largest tree any request may get."""
        g = gain_curve(self.cfg.max_depth, max(widths), acc)
        return float(g[min(self.cfg.node_cap, len(g) - 1)])

    def _compose(self, view: BatchView, arr: _Arrays, widths, acc, shape):
        """The pass's prefill and tree shape, composed (``sched/composition.py``):
        firm prefill (strict classes, and requests at their latest start) first in
        TTFT-deadline order; soft prefill only into the slack the on-pace decoders
        leave under the plan made without it; then the trees re-planned around the
        pass that results. ``shape(prefill)`` is the best shape for a prefill."""
        c = self.cfg
        pre = view.prefilling
        if not pre:
            return {}, shape({})
        key = lambda r: composition.ttft_deadline(r, c.no_ttft_defer_ms)  # noqa: E731
        strict = [r for r in sorted(pre, key=key) if r.rank < c.defer_rank]
        first = composition.chunk_in_order(strict, c.prefill_chunk)
        best = shape(first)
        th = self.correction.theta
        V = view.hw.verify_table(best.budget + c.prefill_chunk + 1)
        speed, per_tok = 1.0 + float(th[1]), float(th[2])
        room = c.prefill_chunk - sum(first.values())
        # a pass that carries a full chunk: what each pass of a prefill will take
        t_pass = best.t_iter + (V[best.budget + room] - V[best.budget]) * speed
        t_pass += per_tok * room
        split = composition.split_prefill(
            pre,
            chunk=c.prefill_chunk,
            t_pass_ms=t_pass,
            margin=self.margin,
            defer_rank=c.defer_rank,
            no_ttft_ms=c.no_ttft_defer_ms,
        )
        firm = composition.chunk_in_order(split.firm, c.prefill_chunk)
        if firm != first:
            best = shape(firm)
        room = c.prefill_chunk - sum(firm.values())
        if not split.soft or room <= 0:
            return firm, best
        g = gain_curve(best.depth, best.width, acc)
        gain = g[np.minimum(best.alloc, len(g) - 1)]
        slope, base = self._coef(arr)
        need = self._requirements(arr, best.t_iter)
        cap = composition.pass_cap_ms(
            need, gain, slope, base, arr.has_tpot, self._reach(widths, acc)
        )
        V = view.hw.verify_table(best.budget + room + 1)
        x = composition.slack_tokens(V, best.budget, best.t_iter, cap, room, speed, per_tok)
        if x < min(c.min_slack_tokens, sum(r.prefill_left for r in split.soft)):
            return firm, best
        soft = composition.chunk_in_order(split.soft, x)
        prefill = {**firm, **soft}
        return prefill, shape(prefill)

    def _best_shape(
        self, view, arr: _Arrays, ds: tuple[int, ...], widths, P, kv, acc, pairs=0.0
    ) -> ShapeChoice:
        """The tree shape (depth in ``ds``, width in ``widths``) whose predicted outcome
        scores best (``_pick``), with that outcome; ``need`` only when ``slo_phase``.
        ``pairs``: the prefill chunks' new x cached token pairs (``prefill_pairs``)."""
        evs = [self._evaluate_depths(view, arr, ds, w, P, kv, acc, pairs) for w in widths]
        for ev in evs:  # a depth the power constraints leave no option at (rate -1)
            if "met_w" in ev:
                ev["met_w"] = np.where(ev["rate"] < 0, -1.0, ev["met_w"])
        m, r, i, j = self._pick(evs, len(ds))
        ev = evs[j]
        energy = float(ev["energy_j"][i]) if "energy_j" in ev else None
        return ShapeChoice(
            energy_j=energy,
            fallback=self._power_fallback(energy, float(ev["t_iter"][i]), len(arr.rid), ds[i]),
            depth=ds[i],
            width=widths[j],
            budget=int(ev["budget"][i]),
            alloc=ev["alloc"][i],
            t_iter=float(ev["t_iter"][i]),
            rate=r,
            score=m,
            t_static=float(ev["static"][i]),
            need=ev["need"][i] if "need" in ev else None,
        )

    def _power_limits(self, view) -> tuple[object | None, float, float]:
        """(the view's PowerModel or None, power cap W, energy per token J): the
        constraints off (0) without a power model, with a warning once."""
        c = self.cfg
        pm = getattr(view, "power", None)
        if pm is None:
            if (c.power_cap_w or c.energy_per_token_j) and not getattr(self, "_warned", False):
                self._warned = True
                warnings.warn(
                    f"{self.name}: power_cap_w / energy_per_token_j set but the view carries "
                    "no PowerModel (no FLOPs/bytes/energy figures for this deployment): "
                    "the power constraints are off",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return None, 0.0, 0.0
        return pm, float(c.power_cap_w), float(c.energy_per_token_j)

    def _power_fallback(self, energy, t_ms: float, n: int, depth: int) -> str | None:
        """ "power_cap" / "energy_budget" when the chosen shape is depth 0 and breaks
        that constraint anyway (nothing cheaper to plan: the prefill is not trimmed, so
        TTFT is not traded for watts), else None."""
        c = self.cfg
        if energy is None or depth > 0:
            return None
        if c.power_cap_w > 0 and energy * 1000.0 > c.power_cap_w * t_ms * (1 + 1e-9):
            return "power_cap"
        if c.energy_per_token_j > 0 and energy > c.energy_per_token_j * n * (1 + 1e-9):
            return "energy_budget"
        return None

    def _pick(self, evs: list[dict], D: int) -> tuple:
        """The (score, rate, depth index, width index) of the shape to take, from the
        evaluations of each width over D depths: the highest rate (the first shape on
        ties), score 0."""
        cand = [(0.0, float(ev["rate"][i]), i, j) for j, ev in enumerate(evs) for i in range(D)]
        return max(cand, key=lambda c: (c[1], -c[3], -c[2]))

    def _evaluate_depths(self, view, arr: _Arrays, ds, w, P, kv, acc, pairs=0.0) -> dict:
        """Predicted outcome of drafting each depth of ``ds`` (0 = no speculation) at
        width w for this batch: per-batch constants here, the per-depth, per-request
        work in compiled loops (``plan_kernel.evaluate_depths``).

        Returns arrays over the depths: ``alloc`` [D, n] (candidates per request),
        ``budget`` [D] (verified tokens), ``t_iter`` [D] (predicted ms), ``static`` [D]
        (the profile's part of it), ``rate`` [D] (predicted decode tokens per ms of the
        iteration's time beyond its prefill chunk's) and, with ``slo_phase``, the
        weighted count of requirements met ``met_w`` [D] and the requirements ``need``
        [D, n] at t_iter."""
        c, hw = self.cfg, view.hw
        n, D = len(arr.rid), len(ds)
        pm, cap_w, ept_j = self._power_limits(view)
        strict = self.slo_phase
        di = np.asarray(ds, dtype=np.int64)
        G, Gs, kmax, kfill = curve_rows(tuple(ds), w, acc, c.node_cap)
        tok0 = n + P
        # HardwareModel.drafting_ms + overhead for every depth; the correction's
        # per-depth part (OnlineCorrection.residual) likewise
        draft = np.zeros(D)
        if di.any():
            first = hw.draft_latency(max(tok0, 1.0))
            step = hw.draft_latency(max(n * w, 1.0))
            draft = np.where(di > 0, first + (di - 1) * step + di * (n * hw.draft_host_ms), 0.0)
        draft = (draft + hw.overhead_ms)[:, None]
        th = self.correction.theta
        fixed = (th[0] + (th[3] + th[4] * n) * di)[:, None] + th[2] * tok0
        # the prefill chunks' attention over their cached prefixes (prefix-cache hits)
        pair_ms = hw.prefill_ms_per_pair * pairs
        base = hw.kv_ms_per_token * kv + pair_ms + draft  # [D, 1]
        V = hw.verify_table(tok0 + n * int(kmax.max()))  # every token count planned for
        masked = arr.constrained_share * view.mask_ms_per_node
        if masked > 0:
            # constrained requests' nodes each cost a grammar mask on the host: priced
            # per verified token at the batch's share of constrained requests
            V = V + masked * np.arange(len(V))
        # a prefill chunk's time is spent whatever the trees: leave it out of the rate,
        # or it makes every extra draft step and candidate look cheap next to it (a
        # 60 ms prefill iteration "gains" rate from a depth-8 tree whose marginal
        # tokens per ms are below what a decode-only iteration achieves)
        t_pre = max(0.0, (V[tok0] - V[n]) * (1.0 + th[1]) + th[2] * P + pair_ms) if P else 0.0
        slope, base_r = self._coef(arr) if strict else (_EMPTY, _EMPTY)
        e0, e_tok = (
            pm.depth_coefficients(di, tok0, kv) if pm is not None else (np.zeros(D), np.zeros(D))
        )
        static_w = float(pm.static_w) if pm is not None else 0.0
        # the goodput phase adds nodes while the predicted rate improves, judged by
        # the rate: choosing it by the (myopic) SLO score instead starves throughput in
        # overload and lowers attainment (tests/test_sim.py; docs/results/shape-choice.md)
        alloc, budget, t_iter, static, rate, met_w, need = plan_kernel.evaluate_depths(
            slope, base_r, arr.has_tpot, arr.weight, G, Gs, kmax, kfill, di, V,
            base[:, 0], fixed[:, 0], float(th[1]), float(th[2]), int(tok0), int(w),
            int(view.free_kv_slots), int(c.max_budget), float(c.max_depth + 1), strict,
            self.one_chain, _EXTRAS, float(t_pre), e0, e_tok, static_w, cap_w, ept_j,
        )  # fmt: skip
        out = {"alloc": alloc, "budget": budget, "t_iter": t_iter, "static": static, "rate": rate}
        if pm is not None:  # predicted J of each depth's best option
            out["energy_j"] = e0 + e_tok * (budget - tok0) + static_w * t_iter * 1e-3
        if strict:
            out["met_w"], out["need"] = met_w, need
        return out

    # ------------------------------------------------------------------ select
    def select(self, view: BatchView, plan: Plan, trees: dict[int, CandidateTree]):
        """rid -> the nodes of its tree to verify (sorted, containing 0): the SLO phase
        (``_slo_phase``), then the goodput phase, over the real candidate trees
        (vectorised)."""
        rids = list(trees)
        if not rids:
            return {}
        R = len(rids)
        n_dec = len(view.decoding) - len(plan.skip)
        P = sum(plan.prefill.values())
        left = max(0, min(plan.budget - n_dec - P, view.free_kv_slots))
        size_l = [len(trees[r].tokens) - 1 for r in rids]
        cap_l = [plan.node_cap.get(r, self.cfg.node_cap) for r in rids]
        if (
            sum(size_l) <= left
            and all(s <= c for s, c in zip(size_l, cap_l))
            and all(trees[r].f[1:].min(initial=1.0) > 0 for r in rids)
        ):
            # everything fits: both phases would select every node
            return {rid: np.arange(s + 1) for rid, s in zip(rids, size_l)}
        sizes = np.array(size_l)
        M = max(int(sizes.max()), 1)
        F = np.full((R, M), -1.0)
        for i, rid in enumerate(rids):
            F[i, : sizes[i]] = trees[rid].f[1:]
        order = np.argsort(-F, axis=1, kind="stable")  # ties: lower index (parent) first
        F = F[np.arange(R)[:, None], order]
        caps = np.minimum(sizes, cap_l)
        k = self._slo_phase(view, plan, rids, F, caps, left)
        left -= int(k.sum())
        if left > 0:
            cols = np.arange(M)[None, :]
            avail = (cols >= k[:, None]) & (cols < caps[:, None])
            vals = np.where(avail, F, -1.0).ravel()
            m = min(left, int(avail.sum()))
            if m > 0:
                top = np.argpartition(-vals, m - 1)[:m]
                top = top[vals[top] > 0]
                k += np.bincount(top // M, minlength=R)
        # row i: the root, then its k[i] chosen nodes in index order
        chosen = np.zeros((R, M + 1), dtype=np.int64)
        chosen[:, 1:] = np.where(np.arange(M)[None, :] < k[:, None], order + 1, M + 1)
        chosen.sort(axis=1)
        return {rid: chosen[i, : ki + 1] for i, (rid, ki) in enumerate(zip(rids, k.tolist()))}

    def _slo_phase(self, view, plan: Plan, rids: list[int], F, caps, left: int) -> np.ndarray:
        """Candidates per tree [R] the SLO phase takes before the goodput phase, of at
        most ``left`` in all (F: each tree's f sorted descending [R, M]; caps [R]).
        Default: none."""
        return np.zeros(len(rids), dtype=np.int64)


class AdaServePolicy(BudgetedPolicy):
    """``adaserve``: the SLO phase, then the goodput phase; the shape that meets the
    most requirements; TTFT-deadline admission and prefill order; overloaded requests
    degraded to a looser class."""

    name = "adaserve"
    slo_phase = True

    def __init__(self, cfg: AdaptiveConfig | None = None):
        super().__init__(cfg)
        self._infeasible_streak: dict[int, int] = {}

    def _prefill_key(self) -> Callable[[ReqView], tuple]:
        """Earliest TTFT deadline first."""
        return _ttft_deadline

    def _composes(self) -> bool:
        """Compose the pass unless ``compose`` is off."""
        return self.cfg.compose

    def _explores(self) -> bool:
        """Explore wider trees unless ``explore_every`` is 0."""
        return self.cfg.explore_every > 0

    def admission_key(self, waiting: ReqView) -> tuple:
        """The admission sort key: past its max queue wait first, then the earliest
        TTFT deadline."""
        # past its max queue wait -> first; then earliest TTFT deadline
        overdue = (
            0
            if waiting.max_queue_ms is not None and waiting.waited_ms >= waiting.max_queue_ms
            else 1
        )
        deadline = (waiting.ttft_ms or 1e9) - waiting.waited_ms
        return (overdue, deadline)

    def _pick(self, evs: list[dict], D: int) -> tuple:
        """The (score, rate, depth index, width index) of the shape to take: of the
        shapes that meet the most requirements (weighted), and of those whose predicted
        rate is within ``rate_tolerance`` of the best of them, the cheapest: the
        shallowest, then the narrowest."""
        cand = [  # (met_w, rate, depth index, width index)
            (float(ev["met_w"][i]), float(ev["rate"][i]), i, j)
            for j, ev in enumerate(evs)
            for i in range(D)
        ]
        top = max(c[0] for c in cand)
        floor = (1.0 - self.cfg.rate_tolerance) * max(c[1] for c in cand if c[0] == top)
        return min((c for c in cand if c[0] == top and c[1] >= floor), key=_cheapest)

    def _overload(
        self, dec: list[ReqView], arr: _Arrays, best: ShapeChoice, widths, acc, plan: Plan
    ) -> tuple[int, ...]:
        """The requests whose requirement no tree can meet, after marking in
        ``plan.degrade`` those infeasible for ``degrade_after`` plans in a row."""
        # beyond reach: not even the biggest tree any request may get would meet the
        # requirement at this plan's pace (a plan that merely chose a smaller tree,
        # or a prediction a little pessimistic, is no reason to degrade anyone)
        reach = self._reach(widths, acc)
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
            s = self._infeasible_streak.get(r.rid, 0) + 1 if r.rid in bad else 0
            self._infeasible_streak[r.rid] = s
            if s >= self.cfg.degrade_after and self.cfg.degrade:
                plan.degrade[r.rid] = "looser"
                self._infeasible_streak[r.rid] = 0
        if len(self._infeasible_streak) > 4 * len(dec) + 64:
            live = {r.rid for r in dec}
            self._infeasible_streak = {
                k: v for k, v in self._infeasible_streak.items() if k in live
            }
        return infeasible

    def _slo_phase(self, view, plan: Plan, rids: list[int], F, caps, left: int) -> np.ndarray:
        """Candidates per tree [R]: each request's fewest best-f nodes whose expected
        gain reaches its requirement A(r) - 1 (capped), the most behind first, until
        ``left`` runs out."""
        k = np.zeros(len(rids), dtype=np.int64)
        state = plan.state
        arr = state.arrays if isinstance(state, BudgetedState) else None
        if arr is None or arr.rid.tolist() != rids:
            by_id = {r.rid: r for r in view.requests}
            arr = _Arrays.of([by_id[r] for r in rids])
        t_iter = plan.t_iter_ms if plan.t_iter_ms is not None else 0.0
        need = self._requirements(arr, t_iter) - 1.0
        cums = np.cumsum(np.maximum(F, 0.0), axis=1)
        k_slo = np.minimum((cums < need[:, None] - 1e-9).sum(1) + 1, caps)
        k_slo[need <= 1e-9] = 0
        # most behind first: largest requirement takes its share of the budget first
        ordr = np.argsort(-need, kind="stable")
        want = k_slo[ordr]
        k[ordr] = np.minimum(np.maximum(left - (np.cumsum(want) - want), 0), want)
        return k


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


def _ttft_deadline(r: ReqView) -> tuple:
    """The prefill sort key: time left to r's TTFT deadline, then its id."""
    return ((r.ttft_ms or 1e9) - r.waited_ms, r.rid)


def _cheapest(c: tuple) -> tuple:
    """Order of (met_w, rate, depth index, width index) candidates by tree cost."""
    return (c[2], c[3], -c[1])


_EMPTY = np.zeros(0)


@lru_cache(maxsize=1)
def _warm_up() -> None:
    """Compile the planner's kernel once per process, when the first policy is built."""
    plan_kernel.warm_up()


_EXTRAS = np.array([0, 4, 8, 16, 32, 64, 128, 256, 512])  # goodput-phase sizes tried

ADAPTIVE_POLICIES: dict[str, type[BudgetedPolicy]] = {
    p.name: p for p in (AdaServePolicy, DynTreePolicy, SmartSpecPolicy)
}


def make_adaptive(name: str, **kwargs) -> BudgetedPolicy:
    """The budgeted policy called ``name``, with ``AdaptiveConfig`` overrides ``kwargs``."""
    if name not in ADAPTIVE_POLICIES:
        raise ValueError(name)
    return ADAPTIVE_POLICIES[name](AdaptiveConfig(**kwargs) if kwargs else None)
