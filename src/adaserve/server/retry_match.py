"""The retries of clients that do not send a seat's ``Retry-Token`` back.

Admission holds a seat for a client refused for room (``core.retry_seats``) under the
``Retry-Token`` of its 429. The official OpenAI clients know nothing of that header, but
they retry a 429 on their own (``max_retries``, 2 by default) after its
``retry-after-ms``, with the same body, and mark each retry with
``x-stainless-retry-count``. So a refusal that held a seat is also remembered by its
tenant and a digest of its body, and a marked retry with that body claims the seat as if
it had brought the token. An unmarked request claims none: a fresh request that repeats
a refused one's body (a benchmark's fixed prompt, a user pressing enter twice) is a new
arrival, not the one told to come back. Event-loop only (not thread-safe).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from adaserve.core.retry_seats import held_for_s

# the header the official OpenAI (Stainless-generated) clients number their retries by
RETRY_COUNT_HEADER = "x-stainless-retry-count"
# seats remembered by body at most (the oldest go first; the seat itself lapses in
# admission at the same time as here)
MAX_REMEMBERED = 4096

K = TypeVar("K")
V = TypeVar("V")


def body_digest(body: bytes) -> bytes:
    """A request body's digest (16 bytes; the body is never kept)."""
    return hashlib.blake2b(body, digest_size=16).digest()


def is_marked_retry(headers: Mapping[str, str]) -> bool:
    """Whether a request says it is a client's retry (``x-stainless-retry-count`` >= 1)."""
    try:
        return int(headers.get(RETRY_COUNT_HEADER, "0")) >= 1
    except ValueError:
        return False


class SeatMemory(Generic[K, V]):
    """Values by key, each kept as long as admission keeps the seat it is about: a
    client told at ``put`` to come back in ``wait_s`` has its seat until that wait and
    the seat's grace have passed (``core.retry_seats``). At most ``max_entries`` (the
    oldest go first). Also the front door's map of seats to replicas
    (``cluster.seat_routes``)."""

    def __init__(
        self, max_entries: int = MAX_REMEMBERED, clock: Callable[[], float] = time.monotonic
    ):
        self.max_entries = max_entries
        self.clock = clock
        self._kept: OrderedDict[K, tuple[V, float]] = OrderedDict()

    def put(self, key: K, value: V, wait_s: float) -> None:
        now = self.clock()
        self._kept.pop(key, None)
        self._kept[key] = (value, now + held_for_s(wait_s))
        while len(self._kept) > self.max_entries:
            self._kept.popitem(last=False)
        while self._kept:  # the oldest first: drop those lapsed
            _, (_, until) = next(iter(self._kept.items()))
            if until >= now:
                break
            self._kept.popitem(last=False)

    def get(self, key: K, pop: bool = False) -> V | None:
        """The value kept under ``key`` while its seat is held (taken out with ``pop``)."""
        got = self._kept.pop(key, None) if pop else self._kept.get(key)
        return None if got is None or got[1] < self.clock() else got[0]


class RetryMatch:
    """Seat tokens by (tenant, body digest), until their seats lapse."""

    def __init__(
        self, max_entries: int = MAX_REMEMBERED, clock: Callable[[], float] = time.monotonic
    ):
        self._tokens: SeatMemory[tuple[str, bytes], str] = SeatMemory(max_entries, clock)
        self.claimed = 0  # seats claimed by a marked retry without the token so far

    def remember(self, tenant: str, digest: bytes | None, token: str, wait_s: float) -> None:
        """A request of ``tenant`` with body ``digest`` was refused and told to come back
        in ``wait_s`` for the seat of ``token`` (kept as long as admission keeps it)."""
        if digest is not None:
            self._tokens.put((tenant, digest), token, wait_s)

    def claim(self, tenant: str, digest: bytes | None, headers: Mapping[str, str]) -> str | None:
        """The seat token a marked retry of ``tenant`` with body ``digest`` comes back
        for (once), or None."""
        if digest is None or not is_marked_retry(headers):
            return None
        token = self._tokens.get((tenant, digest), pop=True)
        if token is not None:
            self.claimed += 1
        return token
