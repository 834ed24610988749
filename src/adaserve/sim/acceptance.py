"""Synthetic draft trees and target acceptance, calibrated to a real pair's statistics.

Model. The target's greedy continuation of a request is one token sequence; at each
position the draft (given the correct prefix) ranks the target's token somewhere. How
often it ranks it first varies along the text: a request moves between an *easy* and a
*hard* regime (a two-state Markov chain over token positions, top-1 agreement ``p_e`` /
``p_h``, stay probabilities ``a`` / ``b``). This persistence matters: speculation starts
right after a rejected token, i.e. preferentially in hard stretches, so a chain of k
drafts is accepted less often than teacher-forced statistics (which average over all
positions) suggest. The regime state of every request is carried across iterations.

Every node the draft expands proposes ``w`` children. Its *confidence*
``c ~ Beta(k*p_s, k*(1-p_s))`` (s = the regime at the children's position) is the
probability that the target's token is the draft's top-1 child; it is the rank-j child
(j >= 2) with probability ``min(q_{j-1}, (1 - c) * s_j)`` and none of the drafted
children otherwise. The target's token at each position is thus the child of one rank
of the *correct* parent: greedy verification accepts at most one child per node, and a
node is accepted only when its parent is -- acceptance is sampled consistently along
paths. The draft reports ``q_1 = c`` (or a sharpened ``c`` with ``overconfidence`` > 1,
which the online calibrator has to learn to undo) and ``q_j`` as above; ranks follow q.

Tree shape: the engine's beam expansion (``adaserve.spec_decode.draft.expand``): depth ``d``,
width ``w``; the root gets ``w`` children; at each later depth the ``w`` nodes of highest
path probability (kept in index order) each get ``w`` children, so a tree has
``w + (d-1) w^2`` candidates, laid out level by level exactly like the engine's.

Arrays are batched over the requests that share a shape: ``[R, N+1]`` (node 0 = root).
The parameters and their calibration: ``adaserve.sim.acceptance_params``. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from adaserve.core.tree import CandidateTree
from adaserve.hardware.calibration import Calibrator
from adaserve.sim import kernels
from adaserve.sim.acceptance_params import POSITION_BLOCK, AcceptanceParams, fit_regimes


# ---------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class TreeLayout:
    """Level-by-level node layout of a depth-d width-w beam tree (shared by requests).

    depth/rank: [N+1]; level_start[t]: index of the first depth-t node (t = 1..d);
    level_start[d+1] = N+1.
    """

    d: int
    w: int
    depth: np.ndarray
    rank: np.ndarray
    tokens: np.ndarray
    level_start: tuple[int, ...]

    @property
    def n(self) -> int:
        return len(self.depth) - 1


@lru_cache(maxsize=128)
def layout(d: int, w: int) -> TreeLayout:
    """The layout of a (d, w) tree: w + (d-1) w^2 candidates."""
    if d < 1 or w < 1:
        raise ValueError("tree depth and width must be >= 1")
    depth, rank, starts = [0], [0], [0, 1]
    for t in range(1, d + 1):
        size = w if t == 1 else w * w
        depth += [t] * size
        rank += [k % w for k in range(size)]
        starts.append(starts[-1] + size)
    arr = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    lay = TreeLayout(d, w, arr(depth), arr(rank), arr(np.arange(len(depth))), tuple(starts))
    for a in (lay.depth, lay.rank, lay.tokens):
        a.flags.writeable = False
    return lay


@dataclass
class TreeBatch:
    """Candidate trees of R requests of one shape.

    parents: [R, N+1] int64; q: [R, N+1] draft probabilities (q[:, 0] = 1);
    target_path: [R, d] int64, the nodes the target would accept in order if all were
    verified (-1 from the first depth where none of the drafted children is its
    token); f: [R, N+1], set by ``apply_calibration``; regimes: [R, d+1] the regime at
    the d+1 positions after the root (the bonus token's regime, after a path of
    length L, is ``regimes[:, L]``).
    """

    lay: TreeLayout
    parents: np.ndarray
    q: np.ndarray
    target_path: np.ndarray
    f: np.ndarray | None = None
    regimes: np.ndarray | None = None  # [R, d+1] regime at positions t+1..t+d+1

    def tree(self, i: int) -> CandidateTree:
        """Request i's tree as the engine's ``CandidateTree`` (views, no copies)."""
        lay = self.lay
        return CandidateTree(
            tokens=lay.tokens,
            parents=self.parents[i],
            depth=lay.depth,
            q=self.q[i],
            rank=lay.rank,
            f=self.f[i] if self.f is not None else self.q[i],
        )


QUANTILES = 2048


class AcceptanceModel:
    """Grows synthetic candidate trees and decides which nodes the target accepts."""

    def __init__(self, params: AcceptanceParams):
        self.params = params
        self._shares = np.asarray(params.rank_share, dtype=float)
        self.regimes = fit_regimes(params.chain, params.after_miss)
        # confidence is sampled by inverse CDF from [regime, QUANTILES] quantiles of its
        # Beta (much cheaper than drawing Betas every iteration)
        self._cq = _confidence_tables(self.regimes.p, params.concentration)
        a, b = self.regimes.stay
        self._stay = np.array([a, b])
        self._eff = _effective_shares(self._cq, self.regimes.stationary, self._shares)
        self._over = float(params.overconfidence)
        # agreement along the output: the easy share moves so that the stationary
        # agreement pi p_easy + (1 - pi) p_hard follows the measured shift per block
        pe, ph = self.regimes.p
        sh = np.asarray(params.position_shift, dtype=float)
        self._pos_delta = sh / (pe - ph) if len(sh) and pe - ph > 0.02 else None

    @property
    def follows_position(self) -> bool:
        """Acceptance varies along the output (the stats' ``agreement_by_position``;
        needs two regimes)."""
        return self._pos_delta is not None

    def position_shares(self, out_pos: np.ndarray, pi: np.ndarray | None) -> np.ndarray | None:
        """[R] easy shares at output positions ``out_pos`` [R]: the request's share ``pi``
        [R] (None: the stationary one) moved by its block's shift; None when the model
        does not follow positions and pi is None."""
        if self._pos_delta is None:
            return pi
        k = np.minimum(np.asarray(out_pos) // POSITION_BLOCK, len(self._pos_delta) - 1)
        base = self.regimes.stationary[0] if pi is None else pi
        return np.clip(base + self._pos_delta[np.maximum(k, 0)], 0.01, 0.99)

    def shares(self, w: int) -> np.ndarray:
        """[w-1] effective shares of ranks 2..w (0 past the known ranks): scaled so that,
        with rank j capped at rank j-1 and at the mass left, P(rank j) keeps its target."""
        out = np.zeros(max(0, w - 1))
        k = min(len(out), len(self._eff))
        out[:k] = self._eff[:k]
        return out

    # ------------------------------------------------------------------ regimes
    def request_shares(self, num: int, rng: np.random.Generator) -> np.ndarray | None:
        """[num] per-request shares of easy positions (``request_spread``): Beta draws
        with the stationary share as mean and variance spread^2 pi (1 - pi); None when
        the spread is 0 (every request follows the stationary chain; no draw made)."""
        sp = self.params.request_spread
        if sp <= 0.0:
            return None
        pi = float(self.regimes.stationary[0])
        k = 1.0 / (sp * sp) - 1.0
        return rng.beta(max(k * pi, 1e-3), max(k * (1.0 - pi), 1e-3), num)

    def _stays(self, pi: np.ndarray | None) -> np.ndarray:
        """[2] stay probabilities, or [R, 2] for per-request easy shares ``pi`` [R]: the
        chain's persistence (a + b - 1) kept, its stationary share moved to pi."""
        if pi is None:
            return self._stay
        lam = self._stay.sum() - 1.0
        pi = np.asarray(pi, dtype=float)
        return np.stack([1.0 - (1.0 - pi) * (1.0 - lam), 1.0 - pi * (1.0 - lam)], axis=1)

    def stationary(self, num: int, rng: np.random.Generator) -> np.ndarray:
        """[num] regime states drawn from the stationary distribution."""
        return (rng.random(num) >= self.regimes.stationary[0]).astype(np.int64)

    def advance(self, states: np.ndarray, steps: np.ndarray, rng, pi=None) -> np.ndarray:
        """Regimes ``steps`` positions after ``states`` (-1 = unknown: stationary);
        ``pi`` [R]: per-request easy shares (``request_shares``) or None."""
        s0 = np.asarray(states, dtype=np.int64)
        if pi is None:
            pi_e = np.full(len(s0), self.regimes.stationary[0])
        else:
            pi_e = np.asarray(pi, dtype=float)
        u = rng.random(len(s0))
        lam = float(self._stay.sum() - 1.0)
        return kernels.advance(s0, np.asarray(steps, dtype=float), u, pi_e, lam)

    def _walk(self, states: np.ndarray, n: int, rng, pi=None) -> np.ndarray:
        """[R, n] regimes of the next n positions after ``states`` [R] (``pi`` as in
        ``advance``)."""
        u = rng.random((len(states), n))
        stay = self._stays(pi)
        return kernels.walk(states, u, stay.reshape(-1, 2))

    # ------------------------------------------------------------------ trees
    def _children(self, rng: np.random.Generator, regime: np.ndarray, w: int):
        """Children of expanded nodes whose children's positions are in ``regime``
        [R, E]: q [R, E, w] and the target's choice [R, E] (rank index, or -1)."""
        u = rng.random((2,) + regime.shape)
        reg = np.ascontiguousarray(regime)
        return kernels.children(reg, u[0], u[1], self._cq, self.shares(w), self._over)

    def grow(
        self,
        d: int,
        w: int,
        num: int,
        rng: np.random.Generator,
        states: np.ndarray | None = None,
        pi: np.ndarray | None = None,
    ) -> TreeBatch:
        """Trees of ``num`` requests with shape (d, w), by beam expansion. ``states``:
        [num] regime at each root's position (None: stationary draws); ``pi``: [num]
        per-request easy shares (``request_shares``) or None."""
        lay = layout(d, w)
        N1 = lay.n + 1
        if states is None:
            states = self.stationary(num, rng)
        reg = self._walk(np.asarray(states, dtype=np.int64), d + 1, rng, pi)  # t+1..
        if w == 1:  # a chain: node t's parent is t-1; the path stops at the first miss
            qc, choice = self._children(rng, reg[:, :d], 1)
            q, path = kernels.chain(qc, choice)
            return TreeBatch(lay, _chain_parents(d, num), q, path, regimes=reg)
        # expanded nodes: the root, then w frontier nodes at each depth 1..d-1
        exp_pos = np.concatenate(([0], np.repeat(np.arange(1, d), w)))
        qc, choice = self._children(rng, reg[:, exp_pos], w)
        parents = np.zeros((num, N1), dtype=np.int64)
        q = np.ones((num, N1))
        tc = np.full(num * N1, -1, dtype=np.int64)  # flat [R, N+1]: target's child
        base = (np.arange(num) * N1)[:, None]
        q[:, 1 : 1 + w] = qc[:, 0]
        logp_prev = np.log(qc[:, 0])  # [R, w] path log-prob of level 1
        tc[base[:, 0]] = np.where(choice[:, 0] >= 0, 1 + choice[:, 0], -1)
        frontier = np.broadcast_to(np.arange(1, 1 + w), (num, w))
        for t in range(2, d + 1):
            a, b = lay.level_start[t], lay.level_start[t + 1]
            e0 = 1 + (t - 2) * w
            lq = qc[:, e0 : e0 + w].reshape(num, w * w)
            parents[:, a:b] = np.repeat(frontier, w, axis=1)
            q[:, a:b] = lq
            ch = choice[:, e0 : e0 + w]
            tc[base + frontier] = np.where(ch >= 0, a + np.arange(w) * w + ch, -1)
            if t < d:
                logp = np.repeat(logp_prev, w, axis=1) + np.log(lq)
                best = np.sort(np.argsort(-logp, axis=1, kind="stable")[:, :w], axis=1)
                logp_prev = np.take_along_axis(logp, best, axis=1)
                frontier = best + a
        path = np.empty((num, d), dtype=np.int64)
        cur = tc[base[:, 0]]
        path[:, 0] = cur
        for t in range(1, d):
            cur = np.where(cur >= 0, tc[base[:, 0] + np.maximum(cur, 0)], -1)
            path[:, t] = cur
        return TreeBatch(lay, parents, q, path, regimes=reg)


def _rank_probs(c: np.ndarray, eff: np.ndarray) -> np.ndarray:
    """[..., 1 + len(eff)] probabilities of ranks 1.. given top-1 confidence c [...]:
    rank j gets eff_j (1 - c), capped by rank j-1's and by the probability left."""
    out = np.empty(c.shape + (1 + len(eff),))
    out[..., 0] = c
    left = 1.0 - c
    prev = c
    for j, e in enumerate(eff, start=1):
        prev = np.minimum(np.minimum(prev, left), e * (1.0 - c))
        out[..., j] = prev
        left = left - prev
    return out


def _effective_shares(cq: np.ndarray, weights: np.ndarray, shares: np.ndarray) -> np.ndarray:
    """Scale each rank share so that E[P(rank j)] over the confidence distribution
    (quantile tables ``cq`` [2, Q], regime weights) equals (1 - E[c]) s_j despite the
    caps of ``_rank_probs`` (as far as the caps allow)."""
    c = cq.ravel()
    wt = np.repeat(np.asarray(weights, dtype=float) / cq.shape[1], cq.shape[1])
    target = (1.0 - float((wt * c).sum())) * shares
    eff = np.zeros(len(shares))
    for j in range(len(shares)):
        lo, hi = 0.0, 64.0
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            eff[j] = mid
            got = float((wt * _rank_probs(c, eff[: j + 1])[:, j + 1]).sum())
            lo, hi = (mid, hi) if got < target[j] else (lo, mid)
        eff[j] = 0.5 * (lo + hi)
    return eff


@lru_cache(maxsize=32)
def _confidence_tables(p: tuple[float, float], k: float) -> np.ndarray:
    """[2, QUANTILES] quantiles of the confidence Beta(k p_s, k (1 - p_s)) per regime."""
    cq = np.stack([_beta_quantiles(min(max(x, 1e-4), 0.9999), k) for x in p])
    cq.flags.writeable = False
    return cq


@lru_cache(maxsize=1024)
def _chain_parents(d: int, num: int) -> np.ndarray:
    """[num, d+1] parents of num chains of depth d (read-only; the root is its own)."""
    p = np.maximum(np.arange(d + 1) - 1, 0)
    p.flags.writeable = False
    return np.broadcast_to(p, (num, d + 1))


def _beta_quantiles(mu: float, k: float, n: int = QUANTILES) -> np.ndarray:
    """[n] quantiles (at (i + 0.5) / n) of Beta(k mu, k (1 - mu)), from the CDF on a
    logit grid (x = sigmoid(z): the density in z, x^a (1 - x)^b, has no singularity at
    0 or 1, where a plain grid in x misses the mass of a skewed Beta: its table for
    mu = 0.97, k = 2 averaged 0.943), then moved so that the table's mean is mu."""
    z = np.linspace(-60.0, 60.0, 240_001)
    a, b = k * mu, k * (1 - mu)
    logw = -a * np.logaddexp(0.0, -z) - b * np.logaddexp(0.0, z)
    cdf = np.cumsum(np.exp(logw - logw.max()))
    cdf /= cdf[-1]
    x = np.interp((np.arange(n) + 0.5) / n, cdf, 1.0 / (1.0 + np.exp(-z)))
    m = float(x.mean())  # the midpoint quantiles still miss a sliver of each tail
    if m < mu:
        return 1.0 - (1.0 - x) * ((1.0 - mu) / (1.0 - m))
    return x * (mu / m)


# ---------------------------------------------------------------------- calibrator
def apply_calibration(cal: Calibrator, batch: TreeBatch) -> np.ndarray:
    """``Calibrator.apply`` over a batch: f = product of the calibrated per-edge
    acceptance along each path. Returns (and stores) f [R, N+1]."""
    f = kernels.path_estimates(batch.parents, batch.q, batch.lay.depth, cal.table())
    batch.f = f
    return f


def accepted_paths(batch: TreeBatch, selected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The target's path cut at its first node that was not selected (or not drafted).

    selected: [R, N+1] bool. Returns (path length [R], on_path [R, N+1] bool, root True).
    """
    return kernels.accepted_paths(batch.target_path, selected)


def observe_batch(
    cal: Calibrator, batch: TreeBatch, selected: np.ndarray, on_path: np.ndarray
) -> None:
    """``Calibrator.observe`` for every verified subtree of the batch at once."""
    lay = batch.lay
    kernels.observe(
        batch.parents, batch.q, lay.depth, lay.rank, selected, on_path,
        cal.tried, cal.accepted, cal.rank_tried, cal.rank_accepted,
    )  # fmt: skip
