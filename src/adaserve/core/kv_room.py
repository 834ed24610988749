"""Admission's KV check: the admitted work must fit the KV pool with the new request.

Every running and queued request is expected to hold, at its longest, its context now,
the output its class is measured to still produce (capped by its ``max_tokens``) and
its measured tree. When that and the new request's exceed the pool, the request is
refused (``KV_FULL``) instead of admitted into a preemption storm. Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from adaserve.core.config import CAPACITY_RETRY_S
from adaserve.errors import AdmissionRejected

if TYPE_CHECKING:
    from adaserve.core.seq import SeqState

# reason of a request refused because the admitted work's KV would overflow the pool
KV_FULL = "kv"


def kv_need(r: SeqState, out_len: dict[str, float], nodes_per_decode: float | None) -> float:
    """KV slots ``r`` is expected to hold at its longest: its context now, the output
    still expected (its class's measured mean output ``out_len``, capped by its
    ``max_tokens``; none until measured) and its measured tree."""
    mean = out_len.get(r.slo.cls)
    left = max(r.max_new_tokens - r.num_output, 0)
    more = min(left, max(mean - r.num_output, 0.0)) if mean is not None else 0.0
    return r.num_tokens + more + (nodes_per_decode or 0.0)


def kv_verdict(
    seq: SeqState,
    admitted: Iterable[SeqState],
    pool: int,
    out_len: dict[str, float],
    nodes_per_decode: float | None,
    finish_rate: float | None,
) -> AdmissionRejected | None:
    """A refusal when the KV that the ``admitted`` requests and ``seq`` are expected to
    hold exceeds the ``pool`` (cached prefix blocks ``seq`` would share do not count);
    Retry-After: the requests that must finish, at the measured ``finish_rate``."""
    held = [kv_need(r, out_len, nodes_per_decode) for r in admitted]
    need = sum(held) + kv_need(seq, out_len, nodes_per_decode) - seq.prefix_hint
    if need <= pool:
        return None
    per = sum(held) / max(len(held), 1)
    rate = finish_rate
    retry = math.ceil((need - pool) / max(per, 1.0)) / rate if rate else CAPACITY_RETRY_S
    return AdmissionRejected(
        f"the admitted requests are expected to hold {need - seq.num_tokens:.0f} KV "
        f"slots and this one {seq.num_tokens}; the KV cache holds {pool}",
        KV_FULL,
        max(1.0, retry),
    )
