"""Selection's two phases over the real candidate trees (vectorised): the SLO phase
(``adaserve``: each request's fewest best-f nodes that meet its requirement, the most
behind first) and the goodput phase (the globally highest-f nodes under the budget)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from adaserve.core.policy import BatchView, Plan
from adaserve.core.tree import CandidateTree

# (view, plan, rids, F, caps, left) -> candidates per tree the SLO phase takes [R]
SloPhase = Callable[[BatchView, Plan, list[int], np.ndarray, np.ndarray, int], np.ndarray]


def select_nodes(
    view: BatchView,
    plan: Plan,
    trees: dict[int, CandidateTree],
    node_cap: int,
    slo_phase: SloPhase,
) -> dict[int, np.ndarray]:
    """rid -> the nodes of its tree to verify (sorted, containing 0): ``slo_phase``'s
    nodes, then the goodput phase's, within the plan's budget and each tree's cap
    (``plan.node_cap``, else ``node_cap``)."""
    rids = list(trees)
    if not rids:
        return {}
    R = len(rids)
    n_dec = len(view.decoding) - len(plan.skip)
    P = sum(plan.prefill.values())
    left = max(0, min(plan.budget - n_dec - P, view.free_kv_slots))
    size_l = [len(trees[r].tokens) - 1 for r in rids]
    cap_l = [plan.node_cap.get(r, node_cap) for r in rids]
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
    k = slo_phase(view, plan, rids, F, caps, left)
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


def slo_phase_counts(need: np.ndarray, F: np.ndarray, caps: np.ndarray, left: int) -> np.ndarray:
    """Candidates per tree [R] of the SLO phase: each request's fewest best-f nodes
    whose expected gain reaches its requirement less the root (``need`` = A(r) - 1;
    capped by ``caps``), the most behind first, until ``left`` runs out (F: each tree's
    f sorted descending [R, M])."""
    k = np.zeros(len(need), dtype=np.int64)
    cums = np.cumsum(np.maximum(F, 0.0), axis=1)
    k_slo = np.minimum((cums < need[:, None] - 1e-9).sum(1) + 1, caps)
    k_slo[need <= 1e-9] = 0
    # most behind first: largest requirement takes its share of the budget first
    ordr = np.argsort(-need, kind="stable")
    want = k_slo[ordr]
    k[ordr] = np.minimum(np.maximum(left - (np.cumsum(want) - want), 0), want)
    return k
