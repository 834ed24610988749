"""Token trees: a ``parents`` array plus tokens; masks and positions are derived.

Node 0 is the root: the last committed token, whose target logits always yield one
new token. Nodes ``1..N`` are draft candidates with ``parents[i] < i`` (parents first).
``parents[0] == 0`` by convention. Torch-free so that policies and the simulator can
use it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass
class CandidateTree:
    """Draft candidates of one request.

    tokens:  [N+1] int64, tokens[0] is the root token
    parents: [N+1] int64, parents[0] == 0, parents[i] < i
    depth:   [N+1] int64, depth[0] == 0
    q:       [N+1] float64, draft probability of the edge into each node (q[0] == 1)
    rank:    [N+1] int64, rank of the node among its parent's children by q (0 = top)
    f:       [N+1] float64, estimated probability that the target accepts the whole
             root-to-node path (f[0] == 1); set by the calibrator
    origin:  [N+1] int64, for a subtree: each node's index in the tree it came from
    """

    tokens: np.ndarray
    parents: np.ndarray
    depth: np.ndarray
    q: np.ndarray
    rank: np.ndarray
    f: np.ndarray
    origin: np.ndarray | None = None

    @property
    def num_candidates(self) -> int:
        return len(self.tokens) - 1

    @classmethod
    def root_only(cls, token: int) -> CandidateTree:
        z = np.zeros(1, dtype=np.int64)
        return cls(
            tokens=np.array([token], dtype=np.int64),
            parents=z.copy(),
            depth=z.copy(),
            q=np.ones(1),
            rank=z.copy(),
            f=np.ones(1),
        )

    def subtree(self, nodes: np.ndarray) -> CandidateTree:
        """The tree induced by ``nodes`` (sorted, containing 0, closed under parent)."""
        nodes = np.asarray(nodes, dtype=np.int64)
        remap = np.full(len(self.tokens), -1, dtype=np.int64)
        remap[nodes] = np.arange(len(nodes))
        parents = remap[self.parents[nodes]]
        if (parents < 0).any():
            raise ValueError("selected nodes are not closed under parent")
        return CandidateTree(
            tokens=self.tokens[nodes],
            parents=parents,
            depth=self.depth[nodes],
            q=self.q[nodes],
            rank=self.rank[nodes],
            f=self.f[nodes],
            origin=nodes,
        )


def is_connected(parents: np.ndarray, nodes: Iterable[int]) -> bool:
    """True when ``nodes`` contains the root and every node's parent."""
    s = set(int(n) for n in nodes)
    return 0 in s and all(int(parents[n]) in s for n in s)


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """[n, n] bool: ``m[i, j]`` is True when j is i or an ancestor of i."""
    n = len(parents)
    m = np.zeros((n, n), dtype=bool)
    m[0, 0] = True
    for i in range(1, n):
        m[i] = m[parents[i]]
        m[i, i] = True
    return m


def scratch_slots_needed(depth: int, width: int) -> int:
    """Scratch slot indices a (depth, width) expansion uses past the committed length."""
    return max(0, depth - 1) * width
