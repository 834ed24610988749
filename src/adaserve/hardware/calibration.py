"""Online calibration: draft probability (and depth) -> observed acceptance rate.

Counts are kept per (depth bucket, draft-probability bucket). A node counts as *tried*
when its parent was accepted (or is the root) and it was verified; it counts as
*accepted* when it lies on the accepted path. The estimate of a bucket is
``(accepted + prior * center) / (tried + prior)``, so with no data it equals the
draft probability itself. The shipped pair's stats file can seed the counts.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from adaserve.core.tree import CandidateTree

NUM_Q_BUCKETS = 10
MAX_DEPTH = 8
MAX_RANK = 8
DEFAULT_RANK_PRIOR = (0.6, 0.15, 0.07, 0.04, 0.03, 0.02, 0.02, 0.01)


class Calibrator:
    """Maps (q, depth) to an acceptance estimate and sets path estimates f on trees."""

    def __init__(self, prior_weight: float = 4.0):
        self.prior = prior_weight
        self.tried = np.zeros((MAX_DEPTH, NUM_Q_BUCKETS))
        self.accepted = np.zeros((MAX_DEPTH, NUM_Q_BUCKETS))
        self.centers = (np.arange(NUM_Q_BUCKETS) + 0.5) / NUM_Q_BUCKETS
        self.base = np.tile(self.centers, (MAX_DEPTH, 1))  # prior mean per bucket
        # acceptance of a tried child by its rank among siblings (for planning)
        self.rank_prior = np.array(DEFAULT_RANK_PRIOR)
        self.rank_tried = np.zeros(MAX_RANK)
        self.rank_accepted = np.zeros(MAX_RANK)

    # ------------------------------------------------------------------ estimates
    def table(self) -> np.ndarray:
        """[MAX_DEPTH, NUM_Q_BUCKETS] acceptance estimates."""
        return (self.accepted + self.prior * self.base) / (self.tried + self.prior)

    def acceptance_by_rank(self) -> np.ndarray:
        """[MAX_RANK] estimated acceptance of a tried child of each sibling rank."""
        w = 20.0
        return (self.rank_accepted + w * self.rank_prior) / (self.rank_tried + w)

    @staticmethod
    def bucket(q: np.ndarray) -> np.ndarray:
        """The draft-probability bucket of each q."""
        return np.minimum((np.asarray(q) * NUM_Q_BUCKETS).astype(np.int64), NUM_Q_BUCKETS - 1)

    def apply(self, tree: CandidateTree) -> None:
        """Nothing; sets ``tree.f`` (path acceptance estimates) from the current table."""
        tab = self.table()
        d = np.clip(tree.depth, 1, MAX_DEPTH) - 1
        acc = tab[d, self.bucket(tree.q)]
        acc[0] = 1.0
        f = np.ones(len(tree.tokens))
        maxd = int(tree.depth.max()) if len(tree.depth) else 0
        for t in range(1, maxd + 1):
            idx = np.nonzero(tree.depth == t)[0]
            f[idx] = f[tree.parents[idx]] * acc[idx]
        tree.f = f

    # ------------------------------------------------------------------ feedback
    def observe(self, tree: CandidateTree, accepted_path: list[int]) -> None:
        """Nothing; records one verification: ``tree`` is the verified subtree (local
        indices)."""
        on_path = np.zeros(len(tree.tokens), dtype=bool)
        on_path[0] = True
        on_path[accepted_path] = True
        tried = on_path[tree.parents]
        tried[0] = False
        if not tried.any():
            return
        d = np.clip(tree.depth[tried], 1, MAX_DEPTH) - 1
        b = self.bucket(tree.q[tried])
        np.add.at(self.tried, (d, b), 1.0)
        np.add.at(self.accepted, (d, b), on_path[tried].astype(float))
        rk = np.minimum(tree.rank[tried], MAX_RANK - 1)
        np.add.at(self.rank_tried, rk, 1.0)
        np.add.at(self.rank_accepted, rk, on_path[tried].astype(float))

    # ------------------------------------------------------------------ seeding
    def seed_from_stats(self, path: str | Path, weight: float = 50.0) -> bool:
        """Whether the prior was seeded from a pair stats file's ``calibration`` table
        (False when the file has none, or a malformed one)."""
        try:
            data = json.loads(Path(path).read_text())
            tab = np.asarray(data["calibration"]["acceptance"], dtype=float)
        except (OSError, KeyError, ValueError, TypeError):
            return False
        rank = data["calibration"].get("acceptance_by_rank") or data.get("acceptance_by_rank")
        if isinstance(rank, list) and rank:
            r = np.clip(np.asarray(rank[:MAX_RANK], dtype=float), 0.0, 1.0)
            self.rank_prior[: len(r)] = r
        if tab.ndim == 1 and tab.shape[0] == NUM_Q_BUCKETS:
            tab = np.tile(tab, (MAX_DEPTH, 1))
        if tab.shape != (MAX_DEPTH, NUM_Q_BUCKETS) or not np.isfinite(tab).all():
            return False
        self.base = np.clip(tab, 0.0, 1.0)
        self.prior = weight
        return True

    def snapshot(self) -> dict:
        """The current estimates and the number of tried nodes (for reports)."""
        return {"acceptance": self.table().round(4).tolist(), "tried": self.tried.sum()}
