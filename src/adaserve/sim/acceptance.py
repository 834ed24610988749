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

Calibration (``AcceptanceParams.from_stats``): the rank shares ``s_j`` from the pair's
acceptance by child rank (P(target token = draft's rank-j token)); the regime chain
fitted (least squares on log-probabilities) to its chain acceptance by depth
(P(first d draft tokens all accepted), teacher-forced). A single regime when the chain
statistics show no persistence (e.g. parametric: one acceptance value).

Tree shape: the engine's beam expansion (``adaserve.spec_decode.draft.expand``): depth ``d``,
width ``w``; the root gets ``w`` children; at each later depth the ``w`` nodes of highest
path probability (kept in index order) each get ``w`` children, so a tree has
``w + (d-1) w^2`` candidates, laid out level by level exactly like the engine's.

Arrays are batched over the requests that share a shape: ``[R, N+1]`` (node 0 = root).
Torch-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from adaserve.core.tree import CandidateTree
from adaserve.sched.calibration import DEFAULT_RANK_PRIOR, Calibrator
from adaserve.sim import kernels


@dataclass(frozen=True)
class AcceptanceParams:
    """top1_by_depth[t-1]: P(target = draft's top-1 child | the t-1 before accepted), the
    teacher-forced chain statistics (last value repeats); rank_share[j-2]: share of the remaining
    probability that goes to the rank-j child (j >= 2; sums to <= 1);
    concentration: Beta concentration of the per-node confidence (small = the draft's
    confidence is informative, bimodal); overconfidence: reported q_1 = c sharpened by
    this exponent (1 = calibrated draft); position_shift[k]: top-1 agreement over output
    tokens [32k, 32k + 32) minus the mean agreement over the tokens the per-depth
    statistics were measured on (last value repeats; empty: the same at every position);
    after_miss: P(top-1 agreement | no agreement at the position before), teacher-forced
    (0: not measured); the regime chain is fitted to it as well as to the chains."""

    top1_by_depth: tuple[float, ...] = (0.6,)
    rank_share: tuple[float, ...] = tuple(
        x / (1 - DEFAULT_RANK_PRIOR[0]) for x in DEFAULT_RANK_PRIOR[1:]
    )
    concentration: float = 2.0
    overconfidence: float = 1.0
    source: str = "parametric"
    # persistent per-request difficulty: each request's share of easy positions is
    # drawn once from a Beta around the stationary share whose standard deviation is
    # this fraction of the largest possible (0 = every request alike)
    request_spread: float = 0.0
    position_shift: tuple[float, ...] = ()
    after_miss: float = 0.0

    def __post_init__(self) -> None:
        if not self.top1_by_depth or not all(0.0 < x < 1.0 for x in self.top1_by_depth):
            raise ValueError("per-depth acceptance must be in (0, 1)")
        if any(x < 0 for x in self.rank_share) or sum(self.rank_share) > 1.0 + 1e-6:
            raise ValueError("rank shares must be >= 0 and sum to <= 1")
        if not self.concentration > 0 or not self.overconfidence > 0:
            raise ValueError("concentration and overconfidence must be positive")
        if not 0.0 <= self.request_spread < 1.0:
            raise ValueError("request spread must be in [0, 1)")
        if not all(math.isfinite(x) and -1.0 < x < 1.0 for x in self.position_shift):
            raise ValueError("position shifts must lie in (-1, 1)")
        if not 0.0 <= self.after_miss < 1.0:
            raise ValueError("agreement after a miss must lie in [0, 1)")

    # ------------------------------------------------------------------ constructors
    @classmethod
    def parametric(
        cls,
        accept: float | list[float] | tuple[float, ...] = 0.6,
        topk_mass: float | None = None,
        k: int = 4,
        concentration: float = 2.0,
        overconfidence: float = 1.0,
    ) -> AcceptanceParams:
        """``accept``: top-1 acceptance (one value, or one per depth); ``topk_mass``:
        P(target token among the draft's top-k) at depth 1 (ranks 2..k share the rest
        geometrically, halving per rank). Default rank shape: the calibrator's prior."""
        top1 = (accept,) if isinstance(accept, (int, float)) else tuple(accept)
        top1 = tuple(float(x) for x in top1)
        shares = AcceptanceParams.rank_share
        if topk_mass is not None:
            if not top1[0] <= topk_mass <= 1.0 or k < 2:
                raise ValueError("top-k mass must lie between the top-1 acceptance and 1")
            g = np.array([0.5**i for i in range(k - 1)])
            rest = (topk_mass - top1[0]) / (1.0 - top1[0]) if top1[0] < 1 else 0.0
            shares = tuple(float(x) for x in g / g.sum() * rest)
        return cls(top1, shares, concentration, overconfidence, "parametric")

    @classmethod
    def from_stats(cls, path: str | Path, concentration: float = 2.0) -> AcceptanceParams:
        """Calibrate from a pair stats file (``acceptance_by_rank``, ``acceptance_by_depth``
        at the top level or under ``calibration``); ValueError when it has neither."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read pair stats {path}: {e}") from None
        return cls.from_stats_dict(data, concentration, f"stats:{Path(path).name}")

    @classmethod
    def from_stats_dict(
        cls, data: dict, concentration: float = 2.0, source: str = "stats"
    ) -> AcceptanceParams:
        """``from_stats`` on an already parsed stats object."""
        path = source
        if not isinstance(data, dict):
            raise ValueError(f"pair stats {path}: not a JSON object")
        by_rank = _probs(_find(data, "acceptance_by_rank"))
        by_depth = _probs(_find(data, "acceptance_by_depth"))
        if not by_rank and not by_depth:
            raise ValueError(f"pair stats {path}: no acceptance_by_rank / acceptance_by_depth")
        shares = AcceptanceParams.rank_share
        if by_rank:
            total = sum(by_rank)
            if total > 1.0:
                by_rank = [x / total for x in by_rank]
            head = min(max(by_rank[0], 0.01), 0.99)
            shares = tuple(x / (1.0 - head) for x in by_rank[1:])
            s = sum(shares)
            if s > 1.0:
                shares = tuple(x / s for x in shares)
        top1: list[float] = []
        if by_depth:
            prev = 1.0
            for x in by_depth:
                if prev <= 1e-6:
                    break
                top1.append(min(max(x / prev, 0.01), 0.99))
                prev = x
        else:
            top1 = [by_rank[0]]
        top1 = [min(max(x, 0.01), 0.99) for x in top1]
        shift = position_shift(_probs(_find(data, "agreement_by_position")), data.get("new_tokens"))
        am = _probs([_find(data, "agreement_after_miss")])
        return cls(
            tuple(top1),
            tuple(shares),
            concentration,
            1.0,
            source,
            position_shift=shift,
            after_miss=min(am[0], 0.99) if am else 0.0,
        )

    def top1(self, depth: int) -> float:
        return self.top1_by_depth[min(depth, len(self.top1_by_depth)) - 1]

    @property
    def chain(self) -> tuple[float, ...]:
        """P(first d top-1 drafts all accepted), d = 1..len(top1_by_depth)."""
        return tuple(float(x) for x in np.cumprod(self.top1_by_depth))

    def as_dict(self) -> dict:
        reg = fit_regimes(self.chain, self.after_miss)
        return {
            "source": self.source,
            "top1_by_depth": [round(x, 4) for x in self.top1_by_depth],
            "regimes": reg.as_dict(),
            "rank_share": [round(x, 4) for x in self.rank_share],
            "concentration": self.concentration,
            "overconfidence": self.overconfidence,
            "request_spread": self.request_spread,
            "position_shift": [round(x, 4) for x in self.position_shift],
            "after_miss": self.after_miss,
        }


POSITION_BLOCK = 32  # output tokens per entry of ``agreement_by_position``


def position_shift(by_pos: list[float], span) -> tuple[float, ...]:
    """Agreement per 32-token output block relative to the mean over the first ``span``
    output tokens (the tokens the per-depth statistics cover; None: all blocks)."""
    if not by_pos:
        return ()
    n = len(by_pos) * POSITION_BLOCK
    if isinstance(span, (int, float)) and math.isfinite(span) and span >= 1:
        n = min(int(span), n)
    w = np.clip(n - POSITION_BLOCK * np.arange(len(by_pos)), 0, POSITION_BLOCK)
    base = float(np.dot(w, by_pos) / w.sum())
    return tuple(float(x) - base for x in by_pos)


def _find(d: dict, key: str):
    for scope in (d, d.get("calibration"), d.get("pair"), d.get("stats")):
        if isinstance(scope, dict) and key in scope:
            return scope[key]
    return None


def _probs(v) -> list[float]:
    if not isinstance(v, list) or not v:
        return []
    try:
        out = [float(x) for x in v]
    except (TypeError, ValueError):
        return []
    if not all(math.isfinite(x) and 0.0 <= x <= 1.0 for x in out):
        return []
    return out


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


@dataclass(frozen=True)
class Regimes:
    """Two-state Markov chain over token positions: top-1 agreement ``p`` and stay
    probability ``stay`` of the easy (0) and hard (1) regime."""

    p: tuple[float, float]
    stay: tuple[float, float]

    @property
    def stationary(self) -> np.ndarray:
        a, b = self.stay
        if a + b >= 2.0:
            return np.array([0.5, 0.5])
        return np.array([1.0 - b, 1.0 - a]) / (2.0 - a - b)

    def chain(self, depth: int) -> np.ndarray:
        """[depth] P(top-1 agreement at d consecutive positions), stationary start."""
        return _chain_model(
            np.array([self.p[0]]),
            np.array([self.p[1]]),
            np.array([self.stay[0]]),
            np.array([self.stay[1]]),
            depth,
        )[:, 0]

    def as_dict(self) -> dict:
        return {
            "p_easy": round(self.p[0], 4),
            "p_hard": round(self.p[1], 4),
            "stay_easy": round(self.stay[0], 4),
            "stay_hard": round(self.stay[1], 4),
            "easy_share": round(float(self.stationary[0]), 4),
        }


def _chain_model(pe, ph, a, b, depth: int) -> np.ndarray:
    """[depth, G] chain probabilities of G regime chains (vectorised over the grid)."""
    den = np.maximum(2.0 - a - b, 1e-12)
    v0, v1 = (1.0 - b) / den * pe, (1.0 - a) / den * ph
    out = np.empty((depth, len(pe)))
    for d in range(depth):
        out[d] = v0 + v1
        v0, v1 = (v0 * a + v1 * (1.0 - b)) * pe, (v0 * (1.0 - a) + v1 * b) * ph
    return out


def _after_miss(pe, ph, a, b):
    """P(agreement | a miss at the position before) of regime chains (vectorised)."""
    den = np.maximum(2.0 - a - b, 1e-12)
    we, wh = (1.0 - b) / den * (1.0 - pe), (1.0 - a) / den * (1.0 - ph)
    ne = (we * a + wh * (1.0 - b)) / np.maximum(we + wh, 1e-12)
    return ne * pe + (1.0 - ne) * ph


AFTER_MISS_WEIGHT = 8.0  # as many terms as a chain of 8 depths


@lru_cache(maxsize=32)
def fit_regimes(chain: tuple[float, ...], after_miss: float = 0.0) -> Regimes:
    """Least-squares fit (log scale) of a two-regime chain to chain statistics, and to
    the agreement after a miss when it is given (> 0; weighted as 8 chain terms); one
    regime when persistence does not explain them noticeably better. Measured on the
    shipped pair, the agreement after a miss (0.757, against 0.784 overall) pins the
    regimes' persistence: the chains alone fit stretches that a miss ends (0.70 after
    a miss), both together fit regimes that last most of a request."""
    c = np.clip(np.asarray(chain, dtype=float), 1e-4, 1.0)
    D = len(c)
    y = np.log(c)[:, None]
    d = np.arange(1, D + 1)
    p1 = float(np.clip(np.exp((d * y[:, 0]).sum() / (d * d).sum()), 1e-4, 0.9999))
    single = Regimes((p1, p1), (0.5, 0.5))
    err1 = float(((d * math.log(p1) - y[:, 0]) ** 2).sum())
    if after_miss > 0:
        err1 += AFTER_MISS_WEIGHT * (math.log(p1) - math.log(after_miss)) ** 2
    if D < 3:
        return single

    def unpack(th):  # unconstrained -> (p_easy, p_hard / p_easy, stay_easy, stay_hard)
        x = 1.0 / (1.0 + np.exp(-th))  # stays below 0.9995: the chain keeps a stationary share
        stay = np.minimum(0.5 + 0.5 * x[2:], 0.9995)
        return x[0], x[1], stay[0], stay[1]

    def loss(th):  # th: [4, G]
        pe, fr, a, b = unpack(th)
        m = _chain_model(pe, pe * fr, a, b, D)
        err = ((np.log(np.maximum(m, 1e-12)) - y) ** 2).sum(0)
        if after_miss > 0:
            am = np.maximum(_after_miss(pe, pe * fr, a, b), 1e-12)
            err = err + AFTER_MISS_WEIGHT * (np.log(am) - math.log(after_miss)) ** 2
        return err

    # coarse grid, then a pattern search (all 3^4 neighbours at once) from the best point
    g = np.linspace(-6.0, 8.0, 15)
    th = np.stack([x.ravel() for x in np.meshgrid(g, g, g, g, indexing="ij")])
    err = loss(th)
    cur = th[:, int(np.argmin(err))]
    cur_err = float(err.min())
    moves = np.stack([x.ravel() for x in np.meshgrid(*[np.array([-1.0, 0.0, 1.0])] * 4)])
    step = 1.0
    while step > 1e-3:
        cand = cur[:, None] + step * moves
        e = loss(cand)
        i = int(np.argmin(e))
        if e[i] < cur_err - 1e-12:
            cur, cur_err = cand[:, i], float(e[i])
        else:
            step /= 2.0
    pe, fr, a, b = (float(x) for x in unpack(cur))
    best = (cur_err, pe, fr, a, b)
    err, pe, fr, a, b = best
    if not err < 0.7 * err1 - 1e-6:
        return single
    return Regimes((float(pe), float(pe * fr)), (float(a), float(b)))


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
