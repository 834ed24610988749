"""Seats held for refused clients' retries: what makes a Retry-After honest.

At several times capacity, a Retry-After computed from the finish rate is the time a
seat frees, not the time one is free for this client: fresh arrivals take it first.
So a refusal for room holds a seat under a retry token (``AdmissionRejected.retry_token``,
the ``Retry-Token`` header of the 429), due at its Retry-After. The seats are a queue:
each comes due no earlier than one finish interval after the one held before it, and
the Retry-After told is the wait to that due time (at 3x capacity a burst of refusals
told the same wait came back as a burst the batch could not absorb). The wait is told
to the millisecond (``retry-after-ms``, which the official OpenAI clients honour first)
and, rounded up, in whole seconds (``Retry-After``, RFC 9110's delta-seconds): the seat is
due at its place in the queue, and a client that can only read whole seconds comes back
up to a second late (it then counts no seat ahead of it: the seats placed before its own
are due by then). Admission counts held seats into the batch a new request is
judged at: all of them for a new arrival, for the retry that brings its token back those
placed before its own whose clients are not yet late (a client on time is not held back
by one that did not come). A client on time that finds its room still taken by the
requests running waits for it at the door, first in line, when they are predicted to
leave before its latest start (``AdmissionControl._door``), instead of being refused
again. The official OpenAI clients retry without the token; the server knows their
retries by body (``server.retry_match``). Clients that never retry would hold room for nothing, so
held seats count in the share of recent seats whose client came back (``WINDOW`` of
them). Torch-free; time is the scheduler's clock.
"""

from __future__ import annotations

import math
import secrets
from collections import deque

from adaserve.core.promise import WINDOW

# a held seat waits this long past its due time (or half the wait, if longer): a client
# that honours Retry-After comes back within it
SEAT_GRACE_S = 2.0


def held_for_s(wait_s: float) -> float:
    """How long a seat told ``wait_s`` is held: the wait, then its grace."""
    return wait_s + max(SEAT_GRACE_S, 0.5 * wait_s)


class RetrySeats:
    """The seats held for retries and the share of their clients that came back."""

    def __init__(self) -> None:
        # token -> (place in the queue, due: when its client is told to come, given up)
        self._seats: dict[str, tuple[float, float, float]] = {}
        self._n = 0
        self.returns: deque[bool] = deque(maxlen=WINDOW)  # held seats: came back or not
        self.released = 0  # seats used or lapsed so far (fewer held: admission loosens)

    def __contains__(self, token: str) -> bool:
        return token in self._seats

    def hold(self, now: float, wait_s: float, spacing_s: float = 0.0) -> tuple[str, float]:
        """Hold a seat for a client told at ``now`` to come back in ``wait_s``, placed
        no earlier than ``spacing_s`` after the last seat held (the seats are a queue:
        each takes one leaving request, so clients told apart come back apart, not in a
        burst the batch cannot absorb); its token and the wait it is due in, to the
        millisecond and at least 1 s (``retry-after-ms`` says it exactly;
        ``Retry-After`` rounds it up to whole seconds)."""
        self._n += 1
        token = f"{self._n:x}-{secrets.token_hex(6)}"
        last = max((p for p, _, _ in self._seats.values()), default=-math.inf)
        place = max(now + wait_s, last + spacing_s)
        wait = max(1.0, round(place - now, 3))  # what a header can say: whole ms
        due = now + wait
        self._seats[token] = (place, due, now + held_for_s(wait))
        return token, wait

    def use(self, token: str | None) -> None:
        """The client of ``token`` came back (and was judged): its seat is used."""
        if token is not None and self._seats.pop(token, None) is not None:
            self.returns.append(True)
            self.released += 1

    def gone_at(self, token: str | None) -> float | None:
        """When the seat of ``token`` lapses (None: no such seat held)."""
        seat = self._seats.get(token or "")
        return None if seat is None else seat[2]

    def ahead(self, token: str | None, now: float) -> float:
        """Seats ahead of a request, times the share of held seats whose client came
        back lately: every one for a new request (no held ``token``), for the retry of
        ``token`` those placed before its own whose clients are not late (due after
        ``now``). Seats past their grace lapse here."""
        for t, (_, _, gone) in list(self._seats.items()):
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
        return back * sum(
            1 for place, due, _ in self._seats.values() if place < mine[0] and due > now
        )
