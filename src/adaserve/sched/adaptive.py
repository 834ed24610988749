"""Budgeted tree policies: ``adaserve`` (SLO-customized), ``dyn-tree`` and ``smartspec``.

All three pick the iteration's verification budget B from the hardware model.

* ``adaserve``: SLO phase (most-behind first, each request takes its highest-f
  candidates until its expected accepted tokens reach its requirement A(r), capped),
  then goodput phase (globally highest-f candidates). Prefill is chunked, shares B, and
  waiting requests are ordered by TTFT deadline. Overload: requests whose requirement
  stays infeasible are degraded to a looser class; relaxed requests past their
  maximum queue wait are admitted first.
* ``dyn-tree``: the goodput phase only (global best-f selection under B; EAGLE-2 /
  Sequoia style), SLO-oblivious.
* ``smartspec``: one chain length for the whole batch, chosen to maximise predicted
  goodput, SLO-oblivious.

Quantities (ms): A(r) = (l_r + t_iter) / tpot_r - o_r, clipped to [1, d + 1].
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from adaserve.sched.base import BatchView, Plan, Policy, ReqView, chunk_prefills
from adaserve.spec.tree import CandidateTree

DEPTHS = (0, 1, 2, 3, 4, 5, 6, 8)


@dataclass(frozen=True)
class AdaptiveConfig:
    """Knobs of the budgeted policies (validated)."""

    max_depth: int = 8
    max_width: int = 4
    node_cap: int = 48  # max candidates selected for one request
    prefill_chunk: int = 256
    degrade_after: int = 16  # consecutive infeasible iterations before degrading
    max_budget: int = 1024  # verification tokens per pass, hard ceiling

    def __post_init__(self) -> None:
        if not 1 <= self.max_depth <= 16 or not 1 <= self.max_width <= 8:
            raise ValueError("max_depth must be in [1, 16] and max_width in [1, 8]")
        if self.node_cap < 1 or self.prefill_chunk < 1 or self.max_budget < 1:
            raise ValueError("node_cap, prefill_chunk and max_budget must be positive")


@lru_cache(maxsize=256)
def gain_curve(depth: int, width: int, acc: tuple[float, ...]) -> np.ndarray:
    """Expected accepted tokens of the best k candidates of a typical tree, k = 0..N.

    A synthetic beam tree of the given shape where a child of sibling rank j is
    accepted (given its parent) with probability ``acc[j]``; f of a node is the
    product along its path. Returns the cumulative sums of f sorted descending.
    """
    if depth <= 0:
        return np.zeros(1)
    a = np.asarray(acc[:width]) if width <= len(acc) else np.pad(acc, (0, width - len(acc)))
    fs: list[float] = []
    frontier = [1.0]
    for _ in range(depth):
        kids = sorted((f * a[j] for f in frontier for j in range(width)), reverse=True)
        fs.extend(kids)
        frontier = kids[:width]
    return np.concatenate(([0.0], np.cumsum(sorted(fs, reverse=True))))


class AdaptivePolicy(Policy):
    def __init__(self, name: str, cfg: AdaptiveConfig | None = None, engine=None):
        if name not in ("adaserve", "dyn-tree", "smartspec"):
            raise ValueError(name)
        self.name = name
        self.cfg = cfg or AdaptiveConfig()
        self.engine = engine
        self._infeasible_streak: dict[int, int] = {}
        self.acc_by_rank: tuple[float, ...] = (0.6, 0.15, 0.07, 0.04)
        self.iter_scale = 1.0  # measured / predicted iteration time (EWMA)

    # ------------------------------------------------------------------ helpers
    def _acc(self, view: BatchView) -> tuple[float, ...]:
        acc = getattr(view, "acc_by_rank", None)
        if acc:
            self.acc_by_rank = tuple(round(float(x), 2) for x in acc[: self.cfg.max_width])
        return self.acc_by_rank

    def _width(self, n: int) -> int:
        """Beam width from load: wide trees only when few requests share the pass."""
        if self.name == "smartspec":
            return 1
        return int(np.clip(16 // max(n, 1), 1, self.cfg.max_width))

    def requirement(self, r: ReqView, t_iter: float) -> float:
        """A(r): accepted tokens this iteration that keep r's mean TPOT within target."""
        need = 1.0
        if r.tpot_ms:
            need = (r.decode_ms + t_iter) / r.tpot_ms - r.n_out + 1
        return float(np.clip(need, 1.0, self.cfg.max_depth + 1))

    def admission_key(self, waiting: ReqView) -> tuple:
        if self.name != "adaserve":
            return super().admission_key(waiting)
        # past its max queue wait -> first; then earliest TTFT deadline
        overdue = (
            0
            if waiting.max_queue_ms is not None and waiting.waited_ms >= waiting.max_queue_ms
            else 1
        )
        deadline = (waiting.ttft_ms or 1e9) - waiting.waited_ms
        return (overdue, deadline)

    def feedback(self, plan: Plan, measured_ms: float) -> None:
        """Correct the static profile with measured iteration times (EWMA of the ratio)."""
        pred = plan.info.get("t_iter")
        if pred and measured_ms > 0:
            ratio = measured_ms / (pred / self.iter_scale)
            self.iter_scale = float(np.clip(0.9 * self.iter_scale + 0.1 * ratio, 0.25, 4.0))

    # ------------------------------------------------------------------ plan
    def plan(self, view: BatchView) -> Plan:
        c = self.cfg
        if self.name == "adaserve":
            key = lambda r: ((r.ttft_ms or 1e9) - r.waited_ms, r.rid)  # noqa: E731
        else:
            key = None
        prefill = chunk_prefills(view, c.prefill_chunk, key)
        dec = view.decoding
        hw = view.hw
        if hw is None:
            return Plan(prefill=prefill, fallback="no_profile" if dec else None)
        if not dec:
            return Plan(prefill=prefill)
        n = len(dec)
        P = sum(prefill.values())
        kv = float(sum(r.context_len for r in view.requests))
        acc = self._acc(view)
        w = self._width(n)
        best = None
        for d in DEPTHS:
            if d > c.max_depth:
                break
            cand = self._evaluate(view, dec, d, w, P, kv, acc)
            if best is None or cand["score"] > best["score"]:
                best = cand
        d = best["depth"]
        plan = Plan(prefill=prefill, budget=best["budget"], info=best)
        if d > 0:
            for r, k in zip(dec, best["alloc"]):
                if k > 0:
                    plan.shapes[r.rid] = (d, w)
                    plan.node_cap[r.rid] = c.node_cap
        if self.name == "adaserve":
            self._overload(dec, best, plan)
        return plan

    def _evaluate(self, view, dec, d, w, P, kv, acc) -> dict:
        """Predicted outcome of drafting depth d, width w for this batch."""
        c, hw = self.cfg, view.hw
        n = len(dec)
        g = gain_curve(d, w, acc)  # g[k]: expected accepted from best k nodes
        kmax = min(len(g) - 1, c.node_cap)

        def t_iter(total_nodes: float) -> float:
            return (
                float(hw.iteration_ms(n + P + total_nodes, kv, d, n * w, n + P if d else 0))
                * self.iter_scale
            )

        if d == 0:
            t = t_iter(0)
            score = self._slo_score(dec, t, np.zeros(n)) if self.name == "adaserve" else (0, 0.0)
            return {
                "depth": 0,
                "budget": n + P,
                "alloc": [0] * n,
                "t_iter": t,
                "score": (*score, n / t),
                "rate": n / t,
                "infeasible": [],
            }
        strict = self.name == "adaserve"
        alloc = np.zeros(n, dtype=int)
        t = t_iter(0)
        mem = max(0, view.free_kv_slots - n * w * d)  # slots left for candidate nodes
        if strict:
            for _ in range(2):  # fixed point: requirement depends on t_iter
                need = np.array([self.requirement(r, t) for r in dec]) - 1.0
                alloc = np.minimum(np.searchsorted(g, need - 1e-9), kmax)
                alloc = _fit(alloc, need, mem, c.max_budget - n - P)
                t = t_iter(alloc.sum())
        # goodput phase: add nodes while the predicted rate improves
        marg = np.diff(g)[:kmax]
        best_rate, best_alloc, best_t = -1.0, alloc.copy(), t
        extra = 0
        steps = (0, 4, 8, 16, 32, 64, 128, 256, 512)
        for extra in steps:
            if strict or self.name == "dyn-tree":
                a = _greedy_fill(alloc, marg, extra)
            else:  # smartspec: one chain length for all
                a = np.full(n, min(d, kmax))
                if extra:
                    break
            total = int(a.sum())
            if n + P + total > c.max_budget or total + n * w * d > view.free_kv_slots:
                break  # token budget, or temporary KV slots for candidates and scratch
            tt = t_iter(total)
            exp_tokens = n + float(g[np.minimum(a, len(g) - 1)].sum())
            rate = exp_tokens / tt
            if rate > best_rate:
                best_rate, best_alloc, best_t = rate, a, tt
        got = g[np.minimum(best_alloc, len(g) - 1)]
        score = self._slo_score(dec, best_t, got) if strict else (0, 0.0)
        infeasible = []
        if strict:
            need = np.array([self.requirement(r, best_t) for r in dec]) - 1.0
            infeasible = [
                r.rid for r, nd, gt in zip(dec, need, got) if gt + 1e-9 < nd and r.tpot_ms
            ]
        return {
            "depth": d,
            "budget": int(n + P + best_alloc.sum()),
            "alloc": best_alloc.tolist(),
            "t_iter": best_t,
            "rate": best_rate,
            "score": (*score, best_rate),
            "infeasible": infeasible,
        }

    def _slo_score(self, dec, t: float, expected_extra) -> tuple[int, float]:
        """(weighted count of requests whose requirement the plan meets, minus the
        weighted relative excess of the predicted mean TPOT of those it does not)."""
        met, excess = 0, 0.0
        for r, e in zip(dec, expected_extra):
            if not r.tpot_ms:
                continue
            w = 3 - min(r.rank, 2)  # strict classes weigh more
            if self.requirement(r, t) <= 1.0 + e + 1e-9:
                met += w
            else:
                pred = (r.decode_ms + t) / max(r.n_out + e, 1.0)
                excess += w * max(0.0, pred / r.tpot_ms - 1.0)
        return met, -excess

    def _overload(self, dec: list[ReqView], best: dict, plan: Plan) -> None:
        bad = set(best["infeasible"])
        for r in dec:
            s = self._infeasible_streak.get(r.rid, 0) + 1 if r.rid in bad else 0
            self._infeasible_streak[r.rid] = s
            if s >= self.cfg.degrade_after:
                plan.degrade[r.rid] = "looser"
                self._infeasible_streak[r.rid] = 0
        if len(self._infeasible_streak) > 4 * len(dec) + 64:
            live = {r.rid for r in dec}
            self._infeasible_streak = {
                k: v for k, v in self._infeasible_streak.items() if k in live
            }

    # ------------------------------------------------------------------ select
    def select(self, view: BatchView, plan: Plan, trees: dict[int, CandidateTree]):
        """SLO phase then goodput phase over the real candidate trees (vectorised)."""
        rids = list(trees)
        if not rids:
            return {}
        by_id = {r.rid: r for r in view.requests}
        M = max(len(trees[r].tokens) - 1 for r in rids)
        R = len(rids)
        F = np.zeros((R, max(M, 1)))
        order = np.zeros((R, max(M, 1)), dtype=np.int64)
        for i, rid in enumerate(rids):
            f = trees[rid].f[1:]
            o = np.lexsort((np.arange(len(f)), -f))
            F[i, : len(f)] = f[o]
            order[i, : len(f)] = o + 1
        counts_avail = np.array([len(trees[r].tokens) - 1 for r in rids])
        caps = np.minimum(
            counts_avail, np.array([plan.node_cap.get(r, self.cfg.node_cap) for r in rids])
        )
        n_dec = len(view.decoding)
        P = sum(plan.prefill.values())
        left = max(0, min(plan.budget - n_dec - P, view.free_kv_slots))
        k = np.zeros(R, dtype=np.int64)
        if self.name == "adaserve":
            t = plan.info.get("t_iter", 0.0)
            need = np.array([self.requirement(by_id[r], t) - 1.0 for r in rids])
            cums = np.cumsum(F, axis=1)
            k_slo = np.minimum((cums < need[:, None] - 1e-9).sum(1) + 1, caps)
            k_slo[need <= 1e-9] = 0
            # most behind first: largest requirement
            for i in np.argsort(-need, kind="stable"):
                take = min(int(k_slo[i]), left)
                k[i] = take
                left -= take
        if left > 0:
            cols = np.arange(F.shape[1])[None, :]
            avail = (cols >= k[:, None]) & (cols < caps[:, None])
            vals = np.where(avail, F, -1.0).ravel()
            m = min(left, int(avail.sum()))
            if m > 0:
                top = np.argpartition(-vals, m - 1)[:m]
                top = top[vals[top] > 0]
                np.add.at(k, top // F.shape[1], 1)
        out = {}
        for i, rid in enumerate(rids):
            out[rid] = np.concatenate(([0], np.sort(order[i, : k[i]])))
        return out


def _fit(alloc: np.ndarray, need: np.ndarray, *caps: int) -> np.ndarray:
    """Trim SLO-phase allocations to the tightest cap, serving the most behind first."""
    cap = max(0, min(caps))
    if alloc.sum() <= cap:
        return alloc
    out = np.zeros_like(alloc)
    left = cap
    for i in np.argsort(-need, kind="stable"):
        out[i] = min(alloc[i], left)
        left -= out[i]
    return out


def _greedy_fill(alloc: np.ndarray, marg: np.ndarray, extra: int) -> np.ndarray:
    """Add ``extra`` nodes to ``alloc`` by highest marginal gain (same curve for all)."""
    a = alloc.copy()
    if extra <= 0 or len(marg) == 0:
        return a
    n = len(a)
    kmax = len(marg)
    # marginal gain of the next node of each request is marg[a]; the curve is concave
    # (sorted f), so a global merge equals repeatedly taking the best next node
    gains = np.where(np.arange(kmax)[None, :] >= a[:, None], marg[None, :], -1.0).ravel()
    m = min(extra, int((gains > 0).sum()))
    if m <= 0:
        return a
    top = np.argpartition(-gains, m - 1)[:m]
    np.add.at(a, top // kmax, 1)
    del n
    return a


def make_adaptive(name: str, engine=None, **kwargs) -> AdaptivePolicy:
    return AdaptivePolicy(name, AdaptiveConfig(**kwargs) if kwargs else None, engine=engine)
