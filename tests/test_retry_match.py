"""``server.retry_match``: the retries of clients that do not send the seat's
``Retry-Token`` back (the official OpenAI clients), matched by tenant and body. No server:
the HTTP path is in ``test_server_shed.py``."""

from __future__ import annotations

from adaserve.server.retry_match import RETRY_COUNT_HEADER, RetryMatch, body_digest


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_marked_retry_with_the_same_body_claims_the_seat_once():
    clock = _Clock()
    m = RetryMatch(clock=clock)
    d = body_digest(b'{"prompt": "x"}')
    m.remember("a", d, "tok-1", 1.5)
    retry = {RETRY_COUNT_HEADER: "1"}
    assert m.claim("a", d, {}) is None  # unmarked: a fresh request with the same body
    assert m.claim("a", d, {RETRY_COUNT_HEADER: "0"}) is None  # the first try
    assert m.claim("b", d, retry) is None  # another tenant's
    assert m.claim("a", body_digest(b'{"prompt": "y"}'), retry) is None  # another body
    assert m.claim("a", d, retry) == "tok-1"
    assert m.claim("a", d, retry) is None  # once
    assert m.claimed == 1
    assert m.claim("a", d, {RETRY_COUNT_HEADER: "junk"}) is None


def test_a_seat_is_remembered_as_long_as_admission_keeps_it():
    """Past its wait and grace (``SEAT_GRACE_S``, or half the wait) the seat has lapsed
    in admission: the body no longer claims it; at most ``max_entries`` are kept."""
    clock = _Clock()
    m = RetryMatch(max_entries=2, clock=clock)
    d1, d2, d3 = (body_digest(bytes([i])) for i in range(3))
    m.remember("a", d1, "t1", 1.0)  # kept until 100 + 1 + 2
    clock.t = 103.5
    assert m.claim("a", d1, {RETRY_COUNT_HEADER: "2"}) is None
    m.remember("a", d1, "t1", 1.0)
    m.remember("a", d2, "t2", 1.0)
    m.remember("a", d3, "t3", 1.0)  # the oldest goes
    assert m.claim("a", d1, {RETRY_COUNT_HEADER: "1"}) is None
    assert m.claim("a", d3, {RETRY_COUNT_HEADER: "1"}) == "t3"
    m.remember("a", None, "t4", 1.0)  # no body read: nothing to match
    assert m.claim("a", None, {RETRY_COUNT_HEADER: "1"}) is None
