"""Each tenant's fair share of a contended batch (admission's last check).

Once a tenant has been refused room (capacity or KV) in the last ``window_s``, the
batch is contended, and a tenant that would then hold more than its fair share of it
(its requests, running and queued, against the batch over the tenants that hold or
want a place) is refused (``FAIR_SHARE``): within its quota it still cannot keep the
seats another tenant is refused. Torch-free; time is the scheduler's clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING

from adaserve.core.config import CAPACITY_RETRY_S
from adaserve.errors import AdmissionRejected

if TYPE_CHECKING:
    from adaserve.core.seq import SeqState

# reason of a request refused because its tenant holds more than its fair share of a
# batch another tenant was refused a place in
FAIR_SHARE = "fair_share"


class FairShare:
    """Who was refused room lately, and the verdict on a tenant's share."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self.starved: dict[str, float] = {}  # tenant -> when it was last refused room

    def refused_room(self, tenant: str | None, now: float) -> None:
        """``tenant`` was refused room at ``now``: the batch is contended."""
        if tenant is not None:
            self.starved[tenant] = now

    def verdict(
        self,
        seq: SeqState,
        running: Iterable[SeqState],
        waiting: Iterable[SeqState],
        finish_rate: float | None,
        now: float,
    ) -> AdmissionRejected | None:
        """A refusal when the batch (``running`` and ``waiting``) is contended (another
        tenant was refused room in the last ``window_s``) and ``seq``'s tenant would
        hold more than its fair share of it: the batch's requests, with ``seq``, over
        the tenants that hold or want a place. Its own requests then wait until its
        share frees, whatever their class. Retry-After: its excess's share of the
        finishes, at the measured ``finish_rate``."""
        me = seq.tenant
        if me is None:
            return None
        for t, when in list(self.starved.items()):
            if now - when > self.window_s:
                del self.starved[t]
        if not any(t != me for t in self.starved):
            return None
        held: dict[str | None, int] = {}
        for r in itertools.chain(running, waiting):
            held[r.tenant] = held.get(r.tenant, 0) + 1
        tenants = {t for t in held if t is not None} | set(self.starved) | {me}
        fair = (sum(held.values()) + 1) / len(tenants)
        mine = held.get(me, 0) + 1
        if mine <= fair:
            return None
        total = max(sum(held.values()), 1)
        rate = finish_rate
        retry = (mine - fair) / (rate * held.get(me, 0) / total) if rate and held.get(me) else None
        return AdmissionRejected(
            f"tenant {me!r} would hold {mine} of the {sum(held.values()) + 1} requests in a "
            f"batch another tenant was refused room in; its fair share is {fair:.1f}",
            FAIR_SHARE,
            max(1.0, retry) if retry else CAPACITY_RETRY_S,
        )
