"""The acceptance model's per-iteration loops, compiled (numba; no torch).

Each function replaces a handful of numpy operations on arrays of a few dozen elements
(requests x tree nodes), where numpy's per-call cost dominates; the simulator runs them
every simulated iteration. Random numbers are drawn by the callers with the same numpy
``Generator`` calls as before, so a seeded simulation gives the same result. Shapes:
R requests, N+1 tree nodes (0 = root), d depth, w width.
"""

from __future__ import annotations

import numpy as np

from adaserve.util.jit import compiled


@compiled
def walk(states, u, stay):
    """[R, n] regimes of the next n positions: from ``states`` [R], position k stays in
    its regime when u[r, k] < stay[s, regime] (s = r, or 0 when stay is [1, 2])."""
    R, n = u.shape
    out = np.empty((R, n), dtype=np.int64)
    per_row = stay.shape[0] > 1
    for r in range(R):
        prev = states[r]
        s = r if per_row else 0
        for k in range(n):
            if not u[r, k] < stay[s, prev]:
                prev = 1 - prev
            out[r, k] = prev
    return out


@compiled
def advance(states, steps, u, pi_e, lam):
    """[R] regimes ``steps`` [R] positions after ``states`` [R] (-1: unknown, drawn
    from the stationary share ``pi_e`` [R]); lam: the chain's persistence a + b - 1."""
    R = states.shape[0]
    out = np.empty(R, dtype=np.int64)
    for r in range(R):
        start = pi_e[r] if states[r] < 0 else (1.0 if states[r] == 0 else 0.0)
        k = max(float(steps[r]), 0.0)
        p_easy = pi_e[r] + lam**k * (start - pi_e[r])
        out[r] = 1 if u[r] >= p_easy else 0
    return out


@compiled
def _rank_probs(c, eff, out):
    """out[0..len(eff)]: rank 1 gets c, rank j gets eff_j (1 - c), capped by rank
    j-1's and by the probability left (``acceptance._rank_probs``)."""
    out[0] = c
    left = 1.0 - c
    prev = c
    for j in range(eff.shape[0]):
        prev = min(min(prev, left), eff[j] * (1.0 - c))
        out[j + 1] = prev
        left = left - prev


@compiled
def children(regime, u0, u1, cq, eff, overconfidence):
    """Children of expanded nodes whose children's positions are in ``regime`` [R, E]
    (``AcceptanceModel._children``): confidence by inverse CDF from the quantile table
    cq [2, Q] at u0, the target's choice among the w = len(eff) + 1 ranks at u1.
    Returns q [R, E, w] (the draft's probabilities) and choice [R, E] (-1: none)."""
    R, E = regime.shape
    w = eff.shape[0] + 1
    Q = cq.shape[1]
    q = np.empty((R, E, w))
    choice = np.empty((R, E), dtype=np.int64)
    acc = np.empty(w)
    for r in range(R):
        for e in range(E):
            c = cq[regime[r, e], int(u0[r, e] * Q)]
            _rank_probs(c, eff, acc)
            s = 0.0
            k = 0
            for j in range(w):
                s += acc[j]
                if u1[r, e] >= s:
                    k += 1
            choice[r, e] = -1 if k >= w else k
            if overconfidence != 1.0:
                ca, na = c**overconfidence, (1.0 - c) ** overconfidence
                _rank_probs(ca / (ca + na), eff, acc)
            for j in range(w):
                q[r, e, j] = max(acc[j], 1e-12)
    return q, choice


@compiled
def chain(qc, choice):
    """Chains from their children (``children`` with w = 1: qc [R, d, 1], choice
    [R, d]): q [R, d+1] (root 1) and the target's path [R, d] (node t + 1 while every
    draft up to it is the target's token, then -1)."""
    R, d = choice.shape
    q = np.empty((R, d + 1))
    path = np.empty((R, d), dtype=np.int64)
    for r in range(R):
        q[r, 0] = 1.0
        hit = True
        for t in range(d):
            q[r, t + 1] = qc[r, t, 0]
            hit = hit and choice[r, t] == 0
            path[r, t] = t + 1 if hit else -1
    return q, path


@compiled
def path_estimates(parents, q, depth, tab):
    """f [R, N+1]: the product of the calibrated acceptance tab[depth - 1, bucket(q)]
    along each node's path (root 1); parents come before their children."""
    R, N1 = q.shape
    D, B = tab.shape
    f = np.empty((R, N1))
    for r in range(R):
        f[r, 0] = 1.0
        for j in range(1, N1):
            b = min(int(q[r, j] * B), B - 1)
            a = tab[min(max(depth[j], 1), D) - 1, b]
            f[r, j] = f[r, parents[r, j]] * a
    return f


@compiled
def accepted_paths(target_path, selected):
    """The target's path cut at its first node not selected (or not drafted): path
    length [R] and on_path [R, N+1] (root True)."""
    R, d = target_path.shape
    length = np.zeros(R, dtype=np.int64)
    on_path = np.zeros(selected.shape, dtype=np.bool_)
    for r in range(R):
        on_path[r, 0] = True
        for t in range(d):
            node = target_path[r, t]
            if node < 0 or not selected[r, node]:
                break
            on_path[r, node] = True
            length[r] += 1
    return length, on_path


@compiled
def observe(parents, q, depth, rank, selected, on_path, tried, accepted, rank_tried, rank_acc):
    """Count every verified node whose parent was accepted (``Calibrator.observe`` for a
    batch): tried / accepted [D, B] by (depth, q bucket), rank_tried / rank_acc by
    sibling rank, in place."""
    R, N1 = q.shape
    D, B = tried.shape
    K = rank_tried.shape[0]
    for r in range(R):
        for j in range(1, N1):
            if not (selected[r, j] and on_path[r, parents[r, j]]):
                continue
            dd = min(max(depth[j], 1), D) - 1
            b = min(int(q[r, j] * B), B - 1)
            rk = min(rank[j], K - 1)
            tried[dd, b] += 1.0
            rank_tried[rk] += 1.0
            if on_path[r, j]:
                accepted[dd, b] += 1.0
                rank_acc[rk] += 1.0
