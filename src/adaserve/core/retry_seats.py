"""Seats held for refused clients' retries: what makes a Retry-After honest.

At several times capacity, a Retry-After computed from the finish rate is the time a
seat frees, not the time one is free for this client: fresh arrivals take it first.
So a refusal for room holds a seat under a retry token (``AdmissionRejected.retry_token``,
the ``Retry-Token`` header of the 429), due at its Retry-After. The seats are a queue:
each comes due no earlier than one finish interval after the one held before it, and
the Retry-After told is the wait to that due time (at 3x capacity a burst of refusals
told the same wait came back as a burst the batch could not absorb). Admission counts held
seats into the batch a new request is judged at, all of them for a new arrival, only
those due before its own for the retry that brings its token back. Clients that never
retry would hold room for nothing, so held seats count in the share of recent seats
whose client came back (``WINDOW`` of them). Torch-free; time is the scheduler's clock.
"""

from __future__ import annotations

import math
import secrets
from collections import deque

from adaserve.core.promise import WINDOW

# a held seat waits this long past its due time (or half the wait, if longer): a client
# that honours Retry-After comes back within it
SEAT_GRACE_S = 2.0


class RetrySeats:
    """The seats held for retries and the share of their clients that came back."""

    def __init__(self) -> None:
        self._seats: dict[str, tuple[float, float]] = {}  # token -> (due, given up)
        self._n = 0
        self.returns: deque[bool] = deque(maxlen=WINDOW)  # held seats: came back or not
        self.released = 0  # seats used or lapsed so far (fewer held: admission loosens)

    def __contains__(self, token: str) -> bool:
        return token in self._seats

    def hold(self, now: float, wait_s: float, spacing_s: float = 0.0) -> tuple[str, float]:
        """Hold a seat for a client told at ``now`` to come back in ``wait_s``, due no
        earlier than ``spacing_s`` after the last seat held (the seats are a queue: each
        takes one leaving request, so clients told apart come back apart, not in a
        burst the batch cannot absorb); its token and the wait it is due in."""
        self._n += 1
        token = f"{self._n:x}-{secrets.token_hex(6)}"
        last = max((d for d, _ in self._seats.values()), default=-math.inf)
        due = max(now + wait_s, last + spacing_s)
        self._seats[token] = (due, due + max(SEAT_GRACE_S, 0.5 * (due - now)))
        return token, due - now

    def use(self, token: str | None) -> None:
        """The client of ``token`` came back (and was judged): its seat is used."""
        if token is not None and self._seats.pop(token, None) is not None:
            self.returns.append(True)
            self.released += 1

    def ahead(self, token: str | None, now: float) -> float:
        """Seats ahead of a request (every one for a new request, those due before its
        own for the retry of ``token``), times the share of held seats whose client
        came back lately; seats past their grace lapse here."""
        for t, (_, gone) in list(self._seats.items()):
            if gone < now:
                del self._seats[t]
                self.returns.append(False)
                self.released += 1
        if not self.returns:
            return 0.0
        back = sum(self.returns) / len(self.returns)
        mine = self._seats.get(token or "")
        if mine is None:
            return back * len(self._seats)
        return back * sum(1 for due, _ in self._seats.values() if due < mine[0])
