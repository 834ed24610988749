"""The planner's core evaluation: what each draft depth at one width would yield for
this batch (``DepthEvaluation``), and the shape a plan takes (``ShapeChoice``).

Per-batch constants are computed here, the per-depth, per-request work in compiled
loops (``policies/plan_kernel.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from adaserve.core.policy import BatchView
from adaserve.policies import plan_kernel
from adaserve.policies.budgeted.columns import Columns
from adaserve.policies.budgeted.config import EXTRAS, AdaptiveConfig
from adaserve.policies.typical_tree import curve_rows

if TYPE_CHECKING:
    from adaserve.hardware.model import HardwareModel
    from adaserve.hardware.power import PowerModel

_EMPTY = np.zeros(0)


@dataclass(frozen=True, eq=False)
class DepthEvaluation:
    """The predicted outcome of drafting each of D depths at one width, arrays over
    the depths:

    alloc:    candidates per decoding request [D, n]
    budget:   verified tokens [D]
    t_iter:   predicted iteration ms [D]
    static:   the profile's part of it [D]
    rate:     predicted decode tokens per ms of the iteration's time beyond its
              prefill chunk's [D]; -1 where the power constraints leave no option
    energy_j: predicted J of each depth's best option [D] (None without a power model)
    met_w:    the weighted count of requirements met [D] (SLO phase only, else None)
    need:     the requirements A(r) at t_iter [D, n] (SLO phase only, else None)
    """

    alloc: np.ndarray
    budget: np.ndarray
    t_iter: np.ndarray
    static: np.ndarray
    rate: np.ndarray
    energy_j: np.ndarray | None = None
    met_w: np.ndarray | None = None
    need: np.ndarray | None = None

    def power_masked(self) -> DepthEvaluation:
        """This evaluation with ``met_w`` -1 at the depths the power constraints leave
        no option at (rate -1), so no such depth wins on requirements met."""
        if self.met_w is None:
            return self
        return replace(self, met_w=np.where(self.rate < 0, -1.0, self.met_w))


@dataclass(frozen=True, eq=False)
class ShapeChoice:
    """The tree shape a plan takes and its predicted outcome.

    alloc:    candidates per decoding request [n]
    t_iter:   predicted iteration ms; ``t_static`` its profile part
    rate:     predicted decode tokens per ms beyond the prefill chunk's time
    score:    weighted count of requirements met (``adaserve``; 0 otherwise)
    need:     the requirements A(r) at t_iter [n] (``adaserve``; None otherwise)
    energy_j: predicted energy of the pass (J; None without a power model)
    fallback: "power_cap" / "energy_budget" when even depth 0 breaks that constraint
    """

    depth: int
    width: int
    budget: int
    alloc: np.ndarray
    t_iter: float
    rate: float
    score: float
    t_static: float
    need: np.ndarray | None = None
    energy_j: float | None = None
    fallback: str | None = None

    @property
    def features(self) -> list[float]:
        """The plan's feature row for ``OnlineCorrection`` (its measured time fits it)."""
        d, n = self.depth, len(self.alloc)
        return [1.0, self.t_static, float(self.budget), float(d), float(d * n)]


def drafting_by_depth(
    hw: HardwareModel, di: np.ndarray, n: int, w: int, catchup: float, context: float
) -> np.ndarray:
    """``HardwareModel.drafting_ms`` of ``n`` requests drafting each depth of ``di`` at
    width ``w`` after a catch-up over ``catchup`` tokens, their ``context`` tokens
    attended by every pass, vectorised over the depths (the planner's hot path;
    ``tests/test_draft_work.py`` holds it to ``drafting_ms``). [D] ms, 0 at depth 0."""
    if not di.any():
        return np.zeros(len(di))
    first = hw.draft_latency(max(catchup, 1.0))
    step = hw.draft_latency(max(n * w, 1.0))
    per_pass = n * hw.draft_host_ms + context * hw.draft_kv_ms_per_token
    # per tree: its verification on the host, and the catch-up's logits row
    trees = n * (hw.tree_host_ms + hw.draft_logits_ms_per_row)
    later = (di - 1) * (step + n * w * hw.draft_logits_ms_per_row)  # each fed token's row
    return np.where(di > 0, first + later + di * per_pass + trees, 0.0)


def evaluate_depths(
    view: BatchView,
    arr: Columns,
    ds: tuple[int, ...],
    w: int,
    P: int,
    kv: float,
    acc: tuple[float, ...],
    pairs: float,
    *,
    cfg: AdaptiveConfig,
    theta: np.ndarray,
    coef: tuple[np.ndarray, np.ndarray] | None,
    one_chain: bool,
    power: tuple[PowerModel | None, float, float],
) -> DepthEvaluation:
    """Predicted outcome of drafting each depth of ``ds`` (0 = no speculation) at width
    ``w`` for this batch of decoders ``arr`` with ``P`` prefill tokens (``pairs`` their
    new x cached token pairs) and ``kv`` context tokens. ``theta``: the online
    correction's coefficients; ``coef``: the requirement coefficients with the SLO phase
    (``requirements.coefficients``; None without it: no ``met_w`` / ``need``);
    ``power``: (PowerModel or None, power cap W, energy per token J)."""
    c, hw = cfg, view.hw
    n, D = len(arr.rid), len(ds)
    pm, cap_w, ept_j = power
    strict = coef is not None
    di = np.asarray(ds, dtype=np.int64)
    G, Gs, kmax, kfill = curve_rows(tuple(ds), w, acc, c.node_cap)
    tok0 = n + P
    # drafting + overhead for every depth; the correction's per-depth part
    # (OnlineCorrection.residual) likewise
    draft = (drafting_by_depth(hw, di, n, w, tok0, arr.context) + hw.host_ms(n))[:, None]
    th = theta
    fixed = (th[0] + (th[3] + th[4] * n) * di)[:, None] + th[2] * tok0
    # the prefill chunks' attention over their cached prefixes (prefix-cache hits)
    pair_ms = hw.prefill_ms_per_pair * pairs
    base = hw.kv_ms_per_token * kv + pair_ms + draft  # [D, 1]
    V = hw.verify_table(tok0 + n * int(kmax.max()))  # every token count planned for
    if hw.logits_ms_per_row:
        # every decoding token (root or tree node) needs its logits row, a prefill
        # chunk's tokens none (``drift.predicted_pass_ms``'s rows)
        V = V + hw.logits_ms_per_row * np.maximum(np.arange(len(V)) - P, 0)
    masked = arr.constrained_share * view.mask_ms_per_node
    if masked > 0:
        # constrained requests' nodes each cost a grammar mask on the host: priced
        # per verified token at the batch's share of constrained requests
        V = V + masked * np.arange(len(V))
    # a prefill chunk's time is spent whatever the trees: leave it out of the rate,
    # or it makes every extra draft step and candidate look cheap next to it (a
    # 60 ms prefill iteration "gains" rate from a depth-8 tree whose marginal
    # tokens per ms are below what a decode-only iteration achieves)
    t_pre = max(0.0, (V[tok0] - V[n]) * (1.0 + th[1]) + th[2] * P + pair_ms) if P else 0.0
    slope, base_r = coef if coef is not None else (_EMPTY, _EMPTY)
    e0, e_tok = (
        pm.depth_coefficients(di, tok0, kv) if pm is not None else (np.zeros(D), np.zeros(D))
    )
    static_w = float(pm.static_w) if pm is not None else 0.0
    # the goodput phase adds nodes while the predicted rate improves, judged by
    # the rate: choosing it by the (myopic) SLO score instead starves throughput in
    # overload and lowers attainment (tests/test_sim.py; docs/results/shape-choice.md)
    alloc, budget, t_iter, static, rate, met_w, need = plan_kernel.evaluate_depths(
        slope, base_r, arr.has_tpot, arr.weight, G, Gs, kmax, kfill, di, V,
        base[:, 0], fixed[:, 0], float(th[1]), float(th[2]), int(tok0), int(w),
        int(view.free_kv_slots), int(c.max_budget), float(c.max_depth + 1), strict,
        one_chain, EXTRAS, float(t_pre), e0, e_tok, static_w, cap_w, ept_j,
    )  # fmt: skip
    energy = None
    if pm is not None:  # predicted J of each depth's best option
        energy = e0 + e_tok * (budget - tok0) + static_w * t_iter * 1e-3
    return DepthEvaluation(
        alloc=alloc,
        budget=budget,
        t_iter=t_iter,
        static=static,
        rate=rate,
        energy_j=energy,
        met_w=met_w if strict else None,
        need=need if strict else None,
    )
