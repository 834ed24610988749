"""SLO-aware pass composition: which prefill tokens share this pass (no torch).

What limits a strict request's TPOT is mostly what shares its pass: a 256-token
prefill chunk can cost twice a decode-only pass on a GPU preset. So the ``adaserve``
planner splits the prefilling requests in two before it plans any tree:

* **firm** prefill runs now, in TTFT-deadline order, up to the chunk: requests of a
  strict class (rank below ``defer_rank``), and every request at or past its
  *latest start*, with those ahead of it in deadline order (earliest deadline first
  prefills them first, so they must run too); then relaxed requests that will miss
  their TTFT whatever happens (*lost*: they would only make the others miss theirs);
* **soft** prefill (a relaxed request with time to spare) runs only into the *slack*
  of the pass: the extra milliseconds the decoders that are on pace can absorb while
  still meeting their requirement A(r) with the trees the plan gives them.

Latest start: a request whose prefill still needs ``p`` tokens (``p`` counting every
request ahead of it in deadline order) needs ``ceil(p / chunk)`` passes of about
``t_pass`` ms. It must start by ``ttft - ceil(p / chunk) * t_pass * (1 + margin) -
t_pass`` ms after its arrival (one pass of headroom: a decision is made once a pass).

A decoder's slack: with the plan's allocation its expected accepted tokens are
``1 + gain_r``, and A(r) grows linearly with the pass time (``t * slope_r + base_r``,
``budgeted.requirements``), so the pass may last up to ``(1 + gain_r - base_r) /
slope_r`` ms before r falls short. The pass's slack is the smallest of these over the
decoders with a TPOT target that can still be helped (a request no tree can save
does not hold everyone else's prefill back; it is the overload path's business).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from adaserve.core.policy import ReqView, chunk_in_order

__all__ = ["chunk_in_order", "latest_start_ms", "pass_cap_ms", "slack_tokens", "split_prefill"]


def ttft_deadline(r: ReqView, no_ttft_ms: float = 1e9) -> tuple[Any, ...]:
    """The prefill sort key: ms left to r's TTFT deadline (``no_ttft_ms`` from arrival
    when it has no TTFT target), then its id."""
    return ((r.ttft_ms if r.ttft_ms is not None else no_ttft_ms) - r.waited_ms, r.rid)


def latest_start_ms(
    ttft_ms: float, tokens_through: int, chunk: int, t_pass_ms: float, margin: float
) -> float:
    """The latest time since arrival (ms) at which a request can start prefilling and
    still see its first token within ``ttft_ms``: ``tokens_through`` prompt tokens (its
    own and those ahead of it) at ``chunk`` per pass of ``t_pass_ms``, the passes
    inflated by ``margin``, less one pass of headroom."""
    passes = math.ceil(max(tokens_through, 0) / max(chunk, 1))
    return ttft_ms - passes * t_pass_ms * (1.0 + margin) - t_pass_ms


@dataclass(frozen=True)
class PrefillSplit:
    """The prefilling requests in TTFT-deadline order, split into those that run now
    (``firm``) and those that run only into the pass's slack (``soft``)."""

    firm: tuple[ReqView, ...]
    soft: tuple[ReqView, ...]


def split_prefill(
    prefilling: list[ReqView],
    *,
    chunk: int,
    t_pass_ms: float,
    margin: float,
    defer_rank: int,
    no_ttft_ms: float,
) -> PrefillSplit:
    """Firm and soft prefill (see the module docstring). A request without a TTFT
    target is treated as one of ``no_ttft_ms``, so it cannot be deferred forever.

    A relaxed request that would miss its TTFT even if its prefill ran alone from now
    on is *lost*: it neither counts in the tokens ahead of the others nor goes ahead
    of them (earliest deadline first spends an overloaded pass on requests already
    lost and so loses the next ones too); it is firm after every other firm request,
    so it still finishes."""
    order: list[Any] = []
    lost: list[Any] = []
    for r in sorted(prefilling, key=lambda r: ttft_deadline(r, no_ttft_ms)):
        ttft = r.ttft_ms if r.ttft_ms is not None else no_ttft_ms
        alone = r.waited_ms + math.ceil(r.prefill_left / max(chunk, 1)) * t_pass_ms
        (lost if r.rank >= defer_rank and alone > ttft else order).append(r)
    last_urgent = -1
    through = 0
    for i, r in enumerate(order):
        through += r.prefill_left
        ttft = r.ttft_ms if r.ttft_ms is not None else no_ttft_ms
        if r.waited_ms >= latest_start_ms(ttft, through, chunk, t_pass_ms, margin):
            last_urgent = i
    firm = tuple(r for i, r in enumerate(order) if i <= last_urgent or r.rank < defer_rank)
    soft = tuple(r for i, r in enumerate(order) if i > last_urgent and r.rank >= defer_rank)
    return PrefillSplit(firm=firm + tuple(lost), soft=soft)


def pass_cap_ms(
    need: np.ndarray,
    gain: np.ndarray,
    slope: np.ndarray,
    base: np.ndarray,
    has_tpot: np.ndarray,
    reach: float,
) -> float:
    """The longest pass (ms) every decoder that can still be helped affords with the
    plan's allocation: min over them of ``(1 + gain - base) / slope``; inf when none
    has a TPOT target. Arrays are [n] over the decoding requests: ``need`` A(r) at the
    plan's pass time, ``gain`` the expected accepted candidates of each request's
    allocation, ``slope`` / ``base`` A(r)'s coefficients; ``reach`` the gain of the
    largest tree any request may get (a request needing more is past helping)."""
    on_pace = has_tpot & (need <= 1.0 + gain + 1e-9) & (slope > 0)
    if not on_pace.any():
        return math.inf
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (1.0 + gain[on_pace] - base[on_pace]) / slope[on_pace]
    t = np.where(np.isfinite(t), t, 0.0)
    return float(t.min())


def slack_tokens(
    V: np.ndarray,
    verified: int,
    t_iter_ms: float,
    cap_ms: float,
    room: int,
    speed: float = 1.0,
    per_token_ms: float = 0.0,
) -> int:
    """The most prefill tokens x <= ``room`` that a pass predicted at ``t_iter_ms`` with
    ``verified`` tokens can add and stay within ``cap_ms``: ``t_iter + (V[verified + x]
    - V[verified]) * speed + per_token_ms * x <= cap`` (V: the profile's verify ms by
    token count, at least ``verified + room + 1`` long; ``speed`` and ``per_token_ms``
    the online correction's factor and per-token term)."""
    if room <= 0 or not cap_ms >= t_iter_ms:
        return 0
    xs = np.arange(room + 1)
    extra = (V[verified + xs] - V[verified]) * speed + per_token_ms * xs
    ok = np.flatnonzero(t_iter_ms + extra <= cap_ms + 1e-9)
    return int(ok[-1]) if len(ok) else 0
