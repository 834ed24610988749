"""The typical tree: what the best k candidates of a tree of a given shape are expected
to yield, from the calibrated acceptance of a child by its sibling rank (no torch).

The budgeted policies plan with these curves before any tree is drafted.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


@lru_cache(maxsize=256)
def gain_curve(depth: int, width: int, acc: tuple[float, ...]) -> np.ndarray:
    """Expected accepted tokens of the best k candidates of a typical tree, k = 0..N.

    A synthetic beam tree of the given shape where a child of sibling rank j is
    accepted (given its parent) with probability ``acc[j]``; f of a node is the
    product along its path. Returns the cumulative sums of f sorted descending.
    """
    return _typical_tree(depth, width, acc)[0]


@lru_cache(maxsize=256)
def depth_curve(depth: int, width: int, acc: tuple[float, ...]) -> np.ndarray:
    """Tree depth the best k candidates of the typical tree reach, k = 0..N (the
    draft must expand that deep to offer them; best-f order follows the top chain
    first, so this is far less than a breadth-first fill would need)."""
    return _typical_tree(depth, width, acc)[1]


def _typical_tree(depth: int, width: int, acc: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    if depth <= 0:
        return np.zeros(1), np.zeros(1, dtype=np.int64)
    a = np.asarray(acc[:width]) if width <= len(acc) else np.pad(acc, (0, width - len(acc)))
    nodes: list[tuple[float, int]] = []  # (f, depth)
    frontier = [1.0]
    for t in range(1, depth + 1):
        kids = sorted((f * a[j] for f in frontier for j in range(width)), reverse=True)
        nodes.extend((f, t) for f in kids)
        frontier = kids[:width]
    nodes.sort(key=lambda x: (-x[0], x[1]))
    f = np.array([x[0] for x in nodes])
    d = np.maximum.accumulate(np.array([x[1] for x in nodes], dtype=np.int64))
    return np.concatenate(([0.0], np.cumsum(f))), np.concatenate(([0], d))


@lru_cache(maxsize=256)
def curve_rows(
    ds: tuple[int, ...], w: int, acc: tuple[float, ...], node_cap: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The typical trees' gain curves of depths ``ds`` at width w as rows (read-only):
    G [D, K+1] (the last value repeated past a curve), Gs (the same with +inf there,
    for counting the values below a need), kmax [D] (nodes a request may get) and
    kfill [D] (how many of those add a positive expected gain)."""
    curves = [gain_curve(d, w, acc) for d in ds]
    kmax = np.array([min(len(g) - 1, node_cap) for g in curves])
    K = int(kmax.max())
    G = np.empty((len(ds), K + 1))
    Gs = np.full((len(ds), K + 1), np.inf)
    for i, g in enumerate(curves):
        m = min(len(g), K + 1)
        G[i, :m] = g[:m]
        G[i, m:] = g[m - 1]
        Gs[i, :m] = g[:m]
    kfill = ((np.diff(G, axis=1) > 0) & (np.arange(K) < kmax[:, None])).sum(1)
    for x in (G, Gs, kmax, kfill):
        x.flags.writeable = False
    return G, Gs, kmax, kfill
