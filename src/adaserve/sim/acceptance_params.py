"""The acceptance model's parameters and their calibration to a pair's statistics.

``AcceptanceParams`` holds what ``adaserve.sim.acceptance.AcceptanceModel`` is built
from; ``Regimes`` is the two-state (easy / hard) Markov chain over token positions and
``fit_regimes`` fits it to the chain statistics.

Calibration (``AcceptanceParams.from_stats``): the rank shares ``s_j`` from the pair's
acceptance by child rank (P(target token = draft's rank-j token)); the regime chain
fitted (least squares on log-probabilities) to its chain acceptance by depth
(P(first d draft tokens all accepted), teacher-forced). A single regime when the chain
statistics show no persistence (e.g. parametric: one acceptance value).

Torch-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from adaserve.hardware.calibration import DEFAULT_RANK_PRIOR


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
