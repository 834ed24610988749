"""The planner's per-depth evaluation as compiled loops (numba; no torch).

``budgeted.evaluation.evaluate_depths`` prepares per-batch constants with numpy and calls
``evaluate_depths`` here. Over [D depths, n requests] arrays of a few dozen elements
a numpy program pays 1-5 us per operation whatever it computes, about 60 operations a
plan; the same arithmetic as loops runs in a few microseconds. The simulator calls the
planner every simulated iteration (tens of thousands per simulated hour), the engine
once per step. ``tests/test_sched.py`` checks the result against a plain per-request
reference.

Compiled on first use and cached on disk (``cache=True``).
"""

from __future__ import annotations

import numpy as np

from adaserve.util.jit import compiled


@compiled
def _t(st, tot, th1, th2, fixed):
    """The predicted ms of a pass whose profile part is st: the profile plus the fitted
    correction, never below half the profile (``OnlineCorrection.residual``)."""
    return max(st + (th1 * st + th2 * tot + fixed), 0.5 * st)


@compiled
def evaluate_depths(
    slope, base_r, has_tpot, weight, G, Gs, kmax, kfill, di, V, base_d, fixed_d,
    th1, th2, tok0, w, free_slots, max_budget, hi, strict, smart, extras, t_pre,
    e0, e_tok, static_w, cap_w, ept_j,
):  # fmt: skip
    """The predicted outcome of each depth (see ``budgeted.evaluation.evaluate_depths``).

    Per request [n]: ``slope``, ``base_r`` (A(r) = clip(t * slope + base, 1, hi)),
    ``has_tpot``, ``weight``. Per depth [D]: the typical tree's gain curve ``G`` and
    ``Gs`` [D, K+1], ``kmax``, ``kfill``, the depth ``di``, the profile's ms beyond the
    verified tokens ``base_d`` and the correction's fixed part ``fixed_d``. ``V``: the
    profile's verify ms by token count. ``extras`` [E]: goodput-phase node counts tried.

    Power (``hardware.power``): a pass at depth d with ``tot`` candidates lasting t ms
    costs ``e0[d] + e_tok[d] * tot + static_w * t / 1000`` J. With ``cap_w`` > 0 an
    option whose predicted power (J over t) exceeds it is not an option; with ``ept_j``
    > 0 neither is one whose energy exceeds ``ept_j`` per expected accepted token (n
    roots + expected gains). Depth 0 without candidates stays an option whatever it
    costs (the plan's floor); a depth with no option left has rate -1.

    Returns alloc [D, n] (candidates per request), budget [D], t_iter [D], static [D]
    (the profile's part of t_iter), rate [D], met_w [D] and need [D, n] (A(r) at
    t_iter; both only for ``strict``)."""
    D, n = G.shape[0], has_tpot.shape[0]
    alloc = np.zeros((D, n), dtype=np.int64)
    t = np.empty(D)
    for d in range(D):  # no candidates
        t[d] = _t(V[tok0] + base_d[d], 0, th1, th2, fixed_d[d])
    if strict:
        # SLO phase: each request's fewest best-f nodes whose expected gain reaches its
        # requirement; a fixed point (the requirement depends on t_iter), two rounds,
        # stopped early when no request at any depth needs a candidate
        need = np.empty((D, n))
        for _ in range(2):
            anyone = False
            for d in range(D):
                for i in range(n):
                    x = min(max(t[d] * slope[i] + base_r[i], 1.0), hi) - (1.0 + 1e-9)
                    need[d, i] = x
                    k = 0
                    while k < Gs.shape[1] and Gs[d, k] < x:
                        k += 1
                    alloc[d, i] = min(k, kmax[d])
                    anyone = anyone or alloc[d, i] > 0
            if not anyone:
                break  # every allocation is 0; t_iter, and so the need, stay as they are
            for d in range(D):
                cap = max(0, min(free_slots - n * w * di[d], max_budget - tok0))
                tot = 0
                for i in range(n):
                    tot += alloc[d, i]
                if tot > cap:  # trim to the cap, the most behind first
                    order = np.argsort(-need[d], kind="mergesort")
                    before = 0
                    for i in order:
                        k = alloc[d, i]
                        alloc[d, i] = min(max(cap - before, 0), k)
                        before += k
                    tot = cap
                t[d] = _t(V[tok0 + tot] + base_d[d], tot, th1, th2, fixed_d[d])
    budget = np.empty(D, dtype=np.int64)
    t_best = np.empty(D)
    static = np.empty(D)
    rate = np.empty(D)
    best_a = np.zeros((D, n), dtype=np.int64)
    A = np.empty(n, dtype=np.int64)
    for d in range(D):
        kf = kfill[d]
        # goodput phase: e more nodes by highest marginal gain, as a water level (every
        # request shares the concave curve, so no sort over n x k): all raised to a
        # common count T (those above keep theirs), the remainder one node each, in
        # request order, to those sitting at T; levels stop at kfill, the nodes that
        # add a positive expected gain
        lv_need = np.empty(kf + 1, dtype=np.int64)
        for T in range(kf + 1):
            s = 0
            for i in range(n):
                s += max(T - alloc[d, i], 0)
            lv_need[T] = s
        best_rate = -np.inf
        for e_idx in range(1 if smart else extras.shape[0]):
            if smart:  # one chain length for the whole batch
                for i in range(n):
                    A[i] = min(di[d], kmax[d])
            else:
                e = extras[e_idx]
                level = 0
                while level < kf and lv_need[level + 1] <= e:
                    level += 1
                rem = e - lv_need[level] if level < kf else 0
                for i in range(n):
                    A[i] = max(alloc[d, i], level)
                    if A[i] == level and rem > 0:
                        A[i] += 1
                        rem -= 1
            tot = 0
            gots = 0.0
            for i in range(n):
                tot += A[i]
                gots += G[d, A[i]]
            # past the token budget or the KV slots (candidates + draft scratch): not
            # an option; the SLO-phase allocation (option 0) was already fitted to both
            ok = tok0 + tot <= max_budget and tot + n * w * di[d] <= free_slots
            if e_idx == 0 and (not smart or di[d] == 0):
                ok = True
            st = V[tok0 + tot] + base_d[d]
            tt = _t(st, tot, th1, th2, fixed_d[d])
            if ok and (cap_w > 0 or ept_j > 0) and (di[d] > 0 or tot > 0):
                ej = e0[d] + e_tok[d] * tot + static_w * tt * 1e-3
                if cap_w > 0 and ej > cap_w * tt * 1e-3:
                    ok = False
                if ept_j > 0 and ej > ept_j * (n + gots):
                    ok = False
            r = (n + gots) / max(tt - t_pre, 0.1 * tt) if ok else -1.0
            if r > best_rate:
                best_rate = r
                budget[d] = tok0 + tot
                t_best[d] = tt
                static[d] = st
                best_a[d] = A
        rate[d] = best_rate
    # SLO score: the weighted count of requirements met. Requests a plan leaves short
    # are not scored by how far short: a score that rewards shrinking their predicted
    # excess favours deep trees, whose marginal ms per token beats the mean TPOT of a
    # request already behind, and so slows everyone's next iterations (it cost 3-4
    # points of attainment on both the CPU profile and the A100 preset)
    met_w = np.zeros(D)
    need_t = np.empty((D, n))
    if strict:
        for d in range(D):
            for i in range(n):
                x = min(max(t_best[d] * slope[i] + base_r[i], 1.0), hi)
                need_t[d, i] = x
                if has_tpot[i] and x <= 1.0 + G[d, best_a[d, i]] + 1e-9:
                    met_w[d] += weight[i]
    return best_a, budget, t_best, static, rate, met_w, need_t


def warm_up() -> None:
    """Nothing; compiles ``evaluate_depths`` (or loads it from the on-disk cache) now,
    with the argument types the planner passes, instead of inside the first plan: a
    cold compile takes seconds, which a server should pay at start, not on its first
    request."""
    f, i = np.zeros(1), np.zeros(1, dtype=np.int64)
    g = np.zeros((1, 2))
    ro = [x.copy() for x in (g, g, i, i)] + [np.ones(4)]
    for x in ro:  # the gain curves and the verify table are read-only arrays
        x.flags.writeable = False
    G, Gs, kmax, kfill, V = ro
    for strict in (True, False):
        evaluate_depths(
            f, f, np.ones(1, dtype=bool), f, G, Gs, kmax, kfill, i, V, f, f,
            0.0, 0.0, 1, 1, 10, 10, 2.0, strict, False, i, 0.0,
            f, f, 0.0, 0.0, 0.0,
        )  # fmt: skip
