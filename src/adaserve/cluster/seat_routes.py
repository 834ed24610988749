"""Which replica holds a refused client's seat, so that its retry goes back there.

Behind ``--replicas`` each replica's admission holds the seats of the clients it refused
(``core.retry_seats``), under the ``Retry-Token`` of its 429. A retry routed to another
replica is judged there as a new arrival, and the seat held where it was refused lapses
unused: the Retry-After it was told is honest only on the replica that told it.

The front door sees every 429 go out, with its ``Retry-Token`` and the
``x-adaserve-replica`` that answered. It remembers the replica by token and, for the
official OpenAI clients' own retries (which send no token but number themselves in
``x-stainless-retry-count``, ``server.retry_match``), by caller and body digest, as long
as the seat is held (its wait and grace, as ``RetryMatch``). A retry that brings either
back is routed to that replica first (``route["replica"]``; ``ray_router`` puts it at
the head of the ranking when it is still a candidate, and falls back to the ranking
when it is gone). Torch-free, no Ray; event-loop only (not thread-safe).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping

from adaserve.errors import RETRY_TOKEN, told_wait_s
from adaserve.server.retry_match import (
    MAX_REMEMBERED,
    SeatMemory,
    body_digest,
    is_marked_retry,
)

REPLICA_HEADER = "x-adaserve-replica"  # the replica that answered (``cluster.replica``)


def caller_key(authorization: str | None) -> bytes:
    """Who a request comes from, as the front door keys seats by body: a digest of its
    ``Authorization`` header (the tenant's key; the key itself is not kept)."""
    return hashlib.blake2b((authorization or "").encode(), digest_size=16).digest()


class SeatRoutes:
    """Replica ids by seat token and by (caller, body digest), until the seats lapse."""

    def __init__(
        self, max_entries: int = MAX_REMEMBERED, clock: Callable[[], float] = time.monotonic
    ):
        self._routes: SeatMemory[tuple[str, bytes], str] = SeatMemory(max_entries, clock)
        self.routed = 0  # retries sent back to the replica holding their seat

    def remember(self, answer: Mapping[str, str], caller: bytes, body: bytes) -> None:
        """A 429 with headers ``answer`` went to ``caller`` for a request with ``body``:
        remember the replica that holds its seat (nothing when it holds none)."""
        replica = answer.get(REPLICA_HEADER)
        token = answer.get(RETRY_TOKEN)
        if not replica or not token:
            return
        wait = max(0.0, told_wait_s(answer) or 0.0)
        for key in (("token", token[:64].encode()), ("body", caller + body_digest(body))):
            self._routes.put(key, replica, wait)

    def replica_for(self, headers: Mapping[str, str], caller: bytes, body: bytes) -> str | None:
        """The replica holding the seat a request comes back for: by the ``Retry-Token``
        it brings, else, for a marked retry, by its caller and body; None otherwise."""
        token = headers.get(RETRY_TOKEN)
        if token:
            key = ("token", token[:64].encode())
        elif is_marked_retry(headers):
            key = ("body", caller + body_digest(body))
        else:
            return None
        replica = self._routes.get(key)
        if replica is not None:
            self.routed += 1
        return replica
