"""The ``adaserve`` pass: which prefill shares it (``compose``, built on
``policies/composition.py``) and which relaxed decoders sit it out (``sit_out``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from adaserve.core.policy import BatchView, ReqView
from adaserve.policies import composition
from adaserve.policies.budgeted.columns import Columns
from adaserve.policies.budgeted.config import AdaptiveConfig
from adaserve.policies.budgeted.evaluation import ShapeChoice
from adaserve.policies.budgeted.requirements import coefficients, requirements
from adaserve.policies.budgeted.widths import reach
from adaserve.policies.typical_tree import gain_curve

ShapeFn = Callable[[dict[int, int]], ShapeChoice]  # prefill -> the best shape for it


def compose(
    view: BatchView,
    arr: Columns,
    widths: tuple[int, ...],
    acc: tuple[float, ...],
    shape: ShapeFn,
    *,
    cfg: AdaptiveConfig,
    theta: np.ndarray,
    margin: float,
    defer_rank: int,
) -> tuple[dict[int, int], ShapeChoice]:
    """The pass's prefill and tree shape, composed (``policies/composition.py``):
    firm prefill (strict classes, and requests at their latest start) first in
    TTFT-deadline order; soft prefill only into the slack the on-pace decoders
    leave under the plan made without it; then the trees re-planned around the
    pass that results. ``shape(prefill)`` is the best shape for a prefill; ``theta``
    the online correction's coefficients; prefill of ranks >= ``defer_rank`` is soft
    until its latest start."""
    c = cfg
    pre = view.prefilling
    if not pre:
        return {}, shape({})
    key = lambda r: composition.ttft_deadline(r, c.no_ttft_defer_ms)  # noqa: E731
    strict = [r for r in sorted(pre, key=key) if r.rank < defer_rank]
    first = composition.chunk_in_order(strict, c.prefill_chunk)
    best = shape(first)
    th = theta
    V = view.hw.verify_table(best.budget + c.prefill_chunk + 1)
    speed, per_tok = 1.0 + float(th[1]), float(th[2])
    room = c.prefill_chunk - sum(first.values())
    # a pass that carries a full chunk: what each pass of a prefill will take
    t_pass = best.t_iter + (V[best.budget + room] - V[best.budget]) * speed
    t_pass += per_tok * room
    split = composition.split_prefill(
        pre,
        chunk=c.prefill_chunk,
        t_pass_ms=t_pass,
        margin=margin,
        defer_rank=defer_rank,
        no_ttft_ms=c.no_ttft_defer_ms,
    )
    firm = composition.chunk_in_order(split.firm, c.prefill_chunk)
    if firm != first:
        best = shape(firm)
    room = c.prefill_chunk - sum(firm.values())
    if not split.soft or room <= 0:
        return firm, best
    g = gain_curve(best.depth, best.width, acc)
    gain = g[np.minimum(best.alloc, len(g) - 1)]
    slope, base = coefficients(arr, cfg, margin)
    need = requirements(arr, best.t_iter, cfg, margin)
    cap = composition.pass_cap_ms(need, gain, slope, base, arr.has_tpot, reach(widths, acc, c))
    V = view.hw.verify_table(best.budget + room + 1)
    x = composition.slack_tokens(V, best.budget, best.t_iter, cap, room, speed, per_tok)
    if x < min(c.min_slack_tokens, sum(r.prefill_left for r in split.soft)):
        return firm, best
    soft = composition.chunk_in_order(split.soft, x)
    prefill = {**firm, **soft}
    return prefill, shape(prefill)


def sit_out(
    dec: list[ReqView],
    arr: Columns,
    best: ShapeChoice,
    widths: tuple[int, ...],
    acc: tuple[float, ...],
    *,
    cfg: AdaptiveConfig,
    margin: float,
) -> set[int]:
    """Relaxed decoders (rank >= ``defer_rank``) that sit this pass out so that strict
    ones behind their requirement get a shorter pass: only while some strict decoder
    the plan leaves short, and only a relaxed decoder that stays within its aim even
    after this pass and the next give it one token (``decode_ms + 2 * t_iter <= aim *
    n_out``). A strict decoder too far behind for one pass's tree to put it back on
    pace (beyond the widest tree's reach) counts too: a shorter pass is what brings its
    mean TPOT back (simulator, this machine's CPU profile, seeds 0-2: interactive
    attainment 29.7 -> 51.7% at 4 req/s on a 30/20/50 mix, the relaxed classes level;
    docs/results/engine-issue30.md, seventh pass)."""
    c = cfg
    g = gain_curve(best.depth, best.width, acc)
    gain = g[np.minimum(best.alloc, len(g) - 1)]
    need = requirements(arr, best.t_iter, cfg, margin)
    ranks = np.array([r.rank for r in dec])
    short = arr.has_tpot & (ranks < c.defer_rank) & (need > 1.0 + gain + 1e-9)
    if not short.any():
        return set()
    aim = arr.tpot * (1.0 - margin)
    fine = arr.decode_ms + 2.0 * best.t_iter <= aim * arr.n_out
    out = arr.has_tpot & (ranks >= c.defer_rank) & fine
    return set(arr.rid[out].tolist())


class Steepness:
    """Whether a hardware model's verification cost grows steeply with the pass's
    tokens: its 64-token verification costs at least ``sit_out_steepness`` one-token
    ones (judged once per hardware model; 0 = never)."""

    __slots__ = ("k", "_hw", "_is")

    def __init__(self, k: float) -> None:
        self.k, self._hw, self._is = k, None, False

    def __call__(self, hw: Any) -> bool:  # a HardwareModel, as ``BatchView.hw``
        """The verdict for ``hw`` (False without one)."""
        if self.k <= 0 or hw is None:
            return False
        if self._hw is not hw:
            self._hw = hw
            self._is = hw.steepness() >= self.k
        return self._is
