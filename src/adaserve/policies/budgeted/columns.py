"""The decoding requests of a plan as columns (the planner's vectorised inputs)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from adaserve.core.policy import ReqView


@dataclass
class Columns:
    """Per-request quantities as arrays (vectorised planning). Mutable only in
    ``coef``, the requirement coefficients cached once computed
    (``requirements.coefficients``)."""

    rid: np.ndarray
    decode_ms: np.ndarray
    n_out: np.ndarray
    tpot: np.ndarray
    has_tpot: np.ndarray
    weight: np.ndarray
    left: np.ndarray  # output tokens still allowed (max_tokens left)
    coef: tuple[np.ndarray, np.ndarray] | None = (
        None  # requirements.coefficients' constants, once computed
    )
    constrained_share: float = 0.0  # of the requests, the share under a grammar
    context: float = 0.0  # the requests' context tokens (what each draft pass attends)

    @classmethod
    def of(cls, reqs: list[ReqView]) -> Columns:
        """The columns of ``reqs``."""
        # one conversion of a row per request (the planner's hot path), then columns;
        # strict classes weigh more: 3, 2, 1
        cols = np.array(
            [
                (r.rid, r.decode_ms, r.n_out, r.tpot_ms or np.nan, 3 - min(r.rank, 2))
                + (min(r.max_tokens, 1 << 20),)
                for r in reqs
            ],
            dtype=float,
        ).T.copy()
        rid, decode_ms, n_out, tpot, weight, left = cols
        return cls(
            rid=rid.astype(np.int64),
            decode_ms=decode_ms,
            n_out=n_out,
            tpot=tpot,
            has_tpot=~np.isnan(tpot),
            weight=weight,
            left=left,
            constrained_share=sum(r.constrained for r in reqs) / len(reqs) if reqs else 0.0,
            context=float(sum(r.context_len for r in reqs)),
        )
